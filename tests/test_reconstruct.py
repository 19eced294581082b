"""Reconstruction after the cut (prune.reconstruct): exactness of `none`, error reduction of `bias` and
`least_squares` measured directly on the calibration data, export round trip of the added biases, settings,
and DDP-style summing of the statistics."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from prunelight.module import frozen_weights_reproducible
from prunelight.export import export_pretrained
from prunelight.families import get_family
from prunelight.importance import build_criterion
from prunelight.reconstruct import FitStats, cut_and_reconstruct, output_proj
from prunelight.settings import PruneSettings, SettingsError
from prunelight.surgery import mask_units
from prunelight.testing import ThreadRanks, allocate_flat, settings_of, tiny_model

IDS = [[5, 9, 17, 33, 2, 64, 100, 7, 11, 40]]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


def _batches(n: int = 4, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (2, 24), generator=g) for _ in range(n)]


def _plan(model, allocation: str = "global", ratio: float = 0.3):
    return allocate_flat(model, build_criterion("random", seed=1).scores(model), ratio, allocation)


def _proj_io(model, batches) -> dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(layer, kind) -> per batch (input, output) of each o_proj / down_proj, from one forward of `model`."""
    family = get_family(model)
    seen: dict = {}
    handles = []
    for i, layer in enumerate(family.layers(model)):
        for kind in ("attn", "mlp"):
            if family.sub_block(layer, kind) is None:
                continue
            hook = lambda m, inp, out, key=(i, kind): seen.setdefault(key, []).append((inp[0], out))  # noqa: E731
            handles.append(output_proj(family, layer, kind).register_forward_hook(hook))
    with torch.no_grad():
        for ids in batches:
            model(ids)
    for h in handles:
        h.remove()
    return seen


def _kept_cols(model, plan, i: int, kind: str) -> torch.Tensor:
    family = get_family(model)
    shape = family.layer_shapes(model)[i]
    spec = next(s for s in family.unit_layout(model.config, shape) if s.kind == kind and s.reads_unit_output)
    keep = plan.layers[i].keep_groups if kind == "attn" else plan.layers[i].keep_channels
    return spec.indices(sorted(keep))


# --- (a) none: the cut model equals the masked model ---------------------------------------------------
def test_none_equals_masked(tiny):
    plan = _plan(tiny)
    masked = copy.deepcopy(tiny)
    mask_units(masked, plan)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        ref, dense = masked(ids).logits, tiny(ids).logits
    figures = cut_and_reconstruct(tiny, plan, _batches(), settings_of(0.3, reconstruct="none"))
    with torch.no_grad():
        out = tiny(ids).logits
    assert figures["method"] == "none"
    assert not torch.allclose(dense, ref, atol=1e-3), "masking changed nothing: the test would be vacuous"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --- (b) least_squares: no sub-block's output error rises, and it falls somewhere ----------------------
@pytest.mark.parametrize("inputs", ["pruned", "dense"])
def test_least_squares_lowers_each_output_error(tiny, inputs):
    """Measured directly: each cut o_proj/down_proj output of the repaired model against the dense model's
    (on the inputs the fit used), vs the same inputs through the cut weights without the refit."""
    plan = _plan(tiny)
    batches = _batches()
    dense_model = copy.deepcopy(tiny)
    dense_io = _proj_io(dense_model, batches)
    figures = cut_and_reconstruct(tiny, plan, batches, settings_of(0.3, reconstruct="least_squares"), inputs=inputs)
    fitted_io = _proj_io(tiny, batches)
    family = get_family(tiny)
    reported = {(f["layer"], f["kind"]): f for f in figures["sub_blocks"]}
    assert reported, "the plan cut nothing: the test would be vacuous"
    for (i, kind), f in reported.items():
        dense_proj = output_proj(family, family.layers(dense_model)[i], kind)
        proj = output_proj(family, family.layers(tiny)[i], kind)
        w_k = dense_proj.weight.detach().index_select(1, _kept_cols(dense_model, plan, i, kind))
        w_fit = proj.weight.detach()
        before = after = total = 0.0
        for b, (x_d, y_d) in enumerate(dense_io[(i, kind)]):
            x_fit = x_d.index_select(-1, _kept_cols(dense_model, plan, i, kind)) if inputs == "dense" \
                else fitted_io[(i, kind)][b][0]  # the repaired model's own input to this projection
            y = y_d - (dense_proj.bias.detach() if dense_proj.bias is not None else 0)
            before += float((x_fit @ w_k.T - y).square().sum())
            after += float((x_fit @ w_fit.T - y).square().sum())
            total += float(y.square().sum())
        assert after <= before * (1 + 1e-5), (i, kind, before, after)
        assert f["rel_err_before"] == pytest.approx(before / total, rel=1e-3, abs=1e-6)
        assert f["rel_err_after"] == pytest.approx(after / total, rel=1e-3, abs=1e-6)
    assert any(f["rel_err_after"] < 0.9 * f["rel_err_before"] for f in reported.values())


# --- (c) bias: lowers the mean output error, survives export and reload --------------------------------
def _load_in_fresh_python(folders: dict) -> dict:
    code = textwrap.dedent(
        f"""
        import json, torch
        import prunelight
        from transformers import AutoModelForCausalLM
        out = {{}}
        for name, folder in {dict((k, str(v)) for k, v in folders.items())!r}.items():
            m = AutoModelForCausalLM.from_pretrained(folder)
            out[name] = [type(m).__name__, m(torch.tensor({IDS})).logits.tolist()]
        print(json.dumps(out))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV, cwd="/")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


CASES = {  # name: (family, config overrides, allocation); uniform shapes would otherwise export a stock config
    "llama": ("llama", {}, "uniform"),
    "qwen2": ("qwen2", {}, "global"),
    "mistral": ("mistral", {}, "global"),
    "llama-attention-bias": ("llama", {"attention_bias": True}, "uniform"),
}


def test_bias_lowers_error_and_survives_export(tmp_path):
    folders, refs = {}, {}
    for name, (fam, overrides, allocation) in CASES.items():
        model = tiny_model(fam, **overrides)
        o_bias = model.model.layers[0].self_attn.o_proj.bias
        o_bias_before = None if o_bias is None else o_bias.detach().clone()
        plan = _plan(model, allocation)
        figures = cut_and_reconstruct(model, plan, _batches(), settings_of(0.3, reconstruct="bias"), inputs="dense")
        subs = figures["sub_blocks"]
        assert subs and all(f["rel_err_after"] <= f["rel_err_before"] for f in subs)
        assert figures["rel_err_after_mean"] < figures["rel_err_before_mean"]
        for layer in model.model.layers:
            assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None
        if o_bias_before is not None:  # a real o_proj bias is updated in place, not replaced
            assert not torch.allclose(model.model.layers[0].self_attn.o_proj.bias, o_bias_before)
        assert model.config.output_bias is True  # no family here states both output biases
        folders[name] = export_pretrained(model, tmp_path / name)
        cfg = json.loads((folders[name] / "config.json").read_text())
        assert cfg["model_type"] == f"prunelight_{fam}" and cfg["output_bias"] is True
        with torch.no_grad():
            refs[name] = model(torch.tensor(IDS)).logits
    got = _load_in_fresh_python(folders)
    for name in CASES:
        cls, logits = got[name]
        assert cls.startswith("Pruned")
        torch.testing.assert_close(torch.tensor(logits), refs[name], atol=1e-5, rtol=1e-5)


def test_bias_is_flap_on_dense_inputs():
    """With dense inputs the added bias is FLAP's W[:, removed] · mean(x_removed)."""
    model = tiny_model("llama")
    plan = _plan(model)
    batches = _batches()
    io = _proj_io(model, batches)
    w = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    cut_and_reconstruct(model, plan, batches, settings_of(0.3, reconstruct="bias"), inputs="dense")
    kept = set(_kept_cols(model, plan, 1, "mlp").tolist())
    removed = torch.tensor([c for c in range(w.shape[1]) if c not in kept])
    x = torch.cat([inp.reshape(-1, inp.shape[-1]) for inp, _ in io[(1, "mlp")]])
    expected = w[:, removed] @ x[:, removed].mean(0)
    torch.testing.assert_close(model.model.layers[1].mlp.down_proj.bias, expected, atol=1e-5, rtol=1e-4)


# --- checkpoints ---------------------------------------------------------------------------------------
def test_checkpoint_keeps_reconstructed_weights():
    from prunelight.module import PruneLM
    from prunelight.testing import tiny_config

    cfg = tiny_config("llama").to_dict()
    lm = PruneLM(config=cfg, attn_implementation="eager", recovery="none")
    lm.configure_model()
    plan = _plan(lm.base_model)
    figures = cut_and_reconstruct(lm.base_model, plan, _batches(), settings_of(0.3, reconstruct="bias"))
    lm.cut_state.mark_cut(plan, reconstructed=True)
    assert figures["method"] == "bias" and lm.cut_state.reconstructed
    lm.lora_active, lm.model_config, lm.cut_state.pretrained_is_cut = True, None, True
    assert not frozen_weights_reproducible(lm), "reconstructed weights are not pretrained + plan"
    lm.lora_active, lm.model_config, lm.cut_state.pretrained_is_cut = False, cfg, False
    ckpt = {"state_dict": lm.state_dict()}
    lm.on_save_checkpoint(ckpt)
    assert ckpt["prunelight"]["weights"] == "all" and ckpt["prunelight"]["output_bias"]

    fresh = PruneLM(config=cfg, attn_implementation="eager", recovery="none")
    fresh.on_load_checkpoint(ckpt)
    fresh.load_state_dict(ckpt["state_dict"])  # strict: the biases exist before the weights load
    assert fresh.cut_state.reconstructed
    ids = torch.tensor(IDS)
    with torch.no_grad():
        torch.testing.assert_close(fresh.base_model.eval()(ids).logits, lm.base_model.eval()(ids).logits)


# --- (d) settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, option", [
    ({"reconstruct": "svd"}, "prune.reconstruct"),
    ({"reconstruct": None}, "prune.reconstruct"),
    ({"reconstruct_ridge": 0}, "prune.reconstruct_ridge"),
    ({"reconstruct_ridge": -0.1}, "prune.reconstruct_ridge"),
    ({"reconstruct_ridge": float("nan")}, "prune.reconstruct_ridge"),
    ({"reconstruct_ridge": True}, "prune.reconstruct_ridge"),
])
def test_settings_refuse_bad_values(kwargs, option):
    with pytest.raises(SettingsError) as err:
        PruneSettings(**kwargs)
    msg = str(err.value)
    assert msg.startswith(f"{option}=") and "is not allowed" in msg and "\n" not in msg


def test_every_reconstruction_is_a_setting_choice():
    for name in ("none", "bias", "least_squares"):
        assert PruneSettings(reconstruct=name, reconstruct_ridge=1).reconstruct == name


# --- (e) DDP: statistics summed over ranks equal the one-pass statistics ---------------------------------
def test_fit_stats_halves_sum_to_one_pass():
    g = torch.Generator().manual_seed(0)
    x, y, w = torch.randn(50, 6, generator=g), torch.randn(50, 4, generator=g), torch.randn(4, 6, generator=g)
    whole = FitStats.empty(6, 4, "cpu", second_order=True)
    whole.add(x, y, w)
    halves = [FitStats.empty(6, 4, "cpu", second_order=True) for _ in range(2)]
    halves[0].add(x[:23], y[:23], w)
    halves[1].add(x[23:], y[23:], w)
    other = halves[1].tensors()
    halves[0].reduce(lambda t, name=iter(other): t + other[next(name)])
    for name, t in whole.tensors().items():
        torch.testing.assert_close(halves[0].tensors()[name], t, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("method, inputs", [("least_squares", "dense"), ("bias", "dense"),
                                            ("least_squares", "pruned")])
def test_two_ranks_match_one_process(method, inputs):
    model = tiny_model("qwen2")
    plan = _plan(model)
    batches = _batches(4)
    settings = settings_of(0.3, reconstruct=method)
    one = copy.deepcopy(model)
    ref = cut_and_reconstruct(one, plan, batches, settings, inputs=inputs)
    models = [copy.deepcopy(model) for _ in range(2)]
    results = ThreadRanks(2).run(
        lambda r, reduce_sum: cut_and_reconstruct(models[r], plan, batches[r::2], settings, reduce_sum, inputs))
    assert results[0]["tokens"] == ref["tokens"] == sum(b.numel() for b in batches)
    state0, state1, state_ref = (m.state_dict() for m in (*models, one))
    for key, v in state_ref.items():
        torch.testing.assert_close(state0[key], state1[key], atol=0, rtol=0)  # ranks agree bit for bit
        torch.testing.assert_close(state0[key], v, atol=1e-5, rtol=1e-4)
    for a, b in zip(results[0]["sub_blocks"], ref["sub_blocks"]):
        assert a["rel_err_after"] == pytest.approx(b["rel_err_after"], rel=1e-4, abs=1e-7)


# --- the run: cut with reconstruction inside fit, record, export, resume ---------------------------------
def test_fit_with_reconstruction_records_exports_and_resumes(tmp_path):
    import lightning as L

    from prunelight.callbacks import PruningCallback, job_callbacks
    from prunelight.data import PruneDataModule, TextSource
    from prunelight.module import PruneLM
    from prunelight.recovery import LoRASettings
    from prunelight.settings import ExportSettings
    from prunelight.testing import tiny_config, tiny_tokenizer, write_tiny_corpus

    def module():
        cfg = tiny_config("llama").to_dict()
        return PruneLM(config=cfg, attn_implementation="eager", lora=LoRASettings(r=4, alpha=8, dropout=0.0))

    def data(folder):
        files = write_tiny_corpus(folder)
        dm = PruneDataModule(calibration=TextSource(path=str(files["valid"])), eval=TextSource(path=str(files["test"])),
                             train=TextSource(path=str(files["train"])), num_samples=8, seq_len=16, batch_size=4,
                             max_eval_blocks=4)
        dm.set_tokenizer(tiny_tokenizer())
        return dm

    def trainer(root, steps, callbacks):
        return L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=callbacks)

    torch.manual_seed(0)
    settings = PruneSettings(ratio=0.25, criterion="taylor", prune_step=1, reconstruct="bias")
    lm = module()
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    prune_cb, export_cb = job_callbacks(settings, ExportSettings(out_dir=str(tmp_path / "run"), figures=False))
    trainer(tmp_path, 3, [prune_cb, ckpt_cb, export_cb]).fit(lm, data(tmp_path / "data"))

    rec = lm.record.reconstruction
    assert rec["method"] == "bias" and rec["rel_err_after_mean"] < rec["rel_err_before_mean"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["reconstruction"]["method"] == "bias"
    assert json.loads((tmp_path / "run" / "model" / "config.json").read_text())["output_bias"] is True

    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert state["prunelight"]["reconstructed"] and state["prunelight"]["weights"] == "all"
    resumed = module()
    t2 = trainer(tmp_path / "b", 4, [PruningCallback(settings)])
    t2.fit(resumed, data(tmp_path / "b" / "data"), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert t2.global_step == 4 and resumed.cut_state.reconstructed
    assert all(layer.self_attn.o_proj.base_layer.bias is not None for layer in resumed.base_model.model.layers)
