"""Per-family checks on tiny models of every supported family, plus Llama 3.2's tied embeddings.

Each family (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3) must: cut exactly (pruned == masked,
including a removed attention, a removed MLP and a dropped layer), keep every layer's query/KV head ratio,
export and reload in a fresh process with equal logits, train LoRA adapters, and run `prunelight fit` end to
end. The KV-cache checks run over the same families in tests/test_kv_cache.py. Phi-3's fused projections are
also checked against an unfused Llama holding the same weights: equal logits and equal scores from every
criterion prove that each unit's slices of qkv_proj / gate_up_proj are the right ones.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import prunelight  # noqa: F401  (registers the pruned model types)
from prunelight.allocation.budget import count_params
from prunelight.calibration import run_calibration
from prunelight.export import export_pretrained
from prunelight.families import KINDS, MODEL_FAMILIES, get_family
from prunelight.importance import CRITERIA, build_criterion
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.recovery import LoRASettings, add_lora, merge_lora
from prunelight.surgery import apply_plan, mask_units
from prunelight.testing import VARIANTS, tiny_config, tiny_fit_args, tiny_model

ROOT = Path(__file__).resolve().parents[1]
NEW = ["qwen3", "gemma2", "gemma3_text", "phi3", "llama_tied"]  # the families added after llama, mistral, qwen2
LAYERS, GROUPS, CHANNELS = 4, 2, 96
IDS = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))  # longer than Gemma's window 4


def _model(variant: str, **overrides):
    family, base = VARIANTS[variant]
    return tiny_model(family, **{"num_hidden_layers": LAYERS, **base, **overrides})


def _plan() -> PrunePlan:
    """One group and half the channels off layer 0, layer 1 dropped, layer 2's attention and layer 3's MLP removed."""
    return PrunePlan(
        [LayerPlan([1], list(range(0, CHANNELS, 2))), LayerPlan([0, 1], list(range(CHANNELS))),
         LayerPlan([], list(range(10, 70))), LayerPlan([0], [])],
        [GROUPS] * LAYERS, [CHANNELS] * LAYERS, drop_layers=[1],
    )


def _masked(model, plan: PrunePlan):
    """The reference: removed units zeroed in a copy (a sub-block with no unit left loses its output bias too)."""
    masked = copy.deepcopy(model)
    mask_units(masked, plan)
    return masked


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pruned_equals_masked_with_removed_blocks_and_a_dropped_layer(variant):
    model = _model(variant)
    family, plan = get_family(model), _plan()
    types = getattr(model.config, "layer_types", None)
    masked = _masked(model, plan)
    with torch.no_grad():
        dense, ref = model(IDS).logits, masked(IDS).logits
    shapes = apply_plan(model, plan)
    with torch.no_grad():
        out = model(IDS).logits
    assert not torch.allclose(dense, ref, atol=1e-3), "masking changed nothing: the test would be vacuous"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert [(s.num_attention_heads, s.num_key_value_heads, s.intermediate_size) for s in shapes] == [
        (2, 1, 48), (0, 0, 60), (2, 1, 0)]
    kept = [0, 2, 3]
    assert model.config.num_hidden_layers == 3 and len(family.layers(model)) == 3
    if types is not None:  # sliding / full attention stays with its layer
        assert model.config.layer_types == [types[i] for i in kept]
    for i, layer in enumerate(family.layers(model)):
        attn = family.attn(layer)
        if attn is not None:
            assert attn.layer_idx == i
            if hasattr(attn, "sliding_window") and types is not None:
                assert (attn.sliding_window is not None) == (model.config.layer_types[i] == "sliding_attention")


@pytest.mark.parametrize("variant", ["qwen3", "gemma2", "gemma3_text", "phi3"])
def test_head_dim_need_not_divide_hidden_size(variant, tmp_path):
    """heads x head_dim = 128 != hidden 64, as in Gemma 2 (8 x 256 vs 2304) and Qwen3-0.6B (16 x 128 vs 1024)."""
    model = _model(variant, head_dim=32)
    plan = _plan()
    masked = _masked(model, plan)
    apply_plan(model, plan)
    with torch.no_grad():
        out = model(IDS).logits
        torch.testing.assert_close(out, masked(IDS).logits, atol=1e-5, rtol=1e-5)
    export_pretrained(model, tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_layer_keeps_its_query_kv_ratio(variant):
    model = _model(variant, num_attention_heads=16, num_key_value_heads=4, head_dim=4)  # 4 query heads per KV head
    family = get_family(model)
    keep = [[0, 2, 3], [1], [0, 1, 2, 3], [2, 3]]
    plan = PrunePlan([LayerPlan(k, list(range(CHANNELS))) for k in keep], [4] * LAYERS, [CHANNELS] * LAYERS)
    shapes = apply_plan(model, plan)
    assert [s.num_key_value_heads for s in shapes] == [3, 1, 4, 2]
    for shape, layer in zip(shapes, family.layers(model)):
        assert shape.num_attention_heads == 4 * shape.num_key_value_heads
        attn = family.attn(layer)
        assert attn.num_key_value_groups == 4 and family.o(attn).in_features == shape.num_attention_heads * 4
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layout_tiles_every_projection_and_costs_match_the_cut(variant):
    model = _model(variant, num_hidden_layers=2)
    family, config = get_family(model), model.config
    # The slices of one tensor (q, k, v of a fused qkv_proj; gate, up of gate_up_proj) cover it exactly once.
    covered: dict[int, list[torch.Tensor]] = {}
    for owned in family.owned_by_layer(model)[0]:
        spec = owned.spec
        assert spec.offset + spec.span <= owned.param.shape[spec.axis]
        covered.setdefault(id(owned.param), []).append(spec.indices(list(range(spec.units))))
    for owned in family.owned_by_layer(model)[0]:
        idx = torch.cat(covered[id(owned.param)]).sort().values
        assert torch.equal(idx, torch.arange(owned.param.shape[owned.spec.axis])), owned.spec
    before = count_params(model)
    one_group = copy.deepcopy(model)
    apply_plan(one_group, PrunePlan([LayerPlan([1], list(range(CHANNELS))), LayerPlan([0, 1], list(range(CHANNELS)))],
                                    [GROUPS] * 2, [CHANNELS] * 2))
    assert before - count_params(one_group) == family.group_param_cost(config)
    one_channel = copy.deepcopy(model)
    apply_plan(one_channel, PrunePlan([LayerPlan([0, 1], list(range(95))), LayerPlan([0, 1], list(range(CHANNELS)))],
                                      [GROUPS] * 2, [CHANNELS] * 2))
    assert before - count_params(one_channel) == family.channel_param_cost(config)


NOOP_NORMS: dict[str, int] = {}  # per variant: norm parameters before removed sub-blocks (filled by `exported`)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every variant cut by `_plan` (non-uniform widths, a dropped layer) and exported; in-memory logits, counts."""
    root = tmp_path_factory.mktemp("modern_exports")
    folders, refs = {}, {}
    for variant in VARIANTS:
        model = _model(variant)
        apply_plan(model, _plan())
        folders[variant] = str(export_pretrained(model, root / variant))
        with torch.no_grad():
            logits = model(IDS).logits
        refs[variant] = (logits, count_params(model), model.config.tie_word_embeddings,
                         getattr(model.config, "layer_types", None))
        fam = get_family(model)  # the served nemotron-nas layout stores no norm before a removed sub-block
        NOOP_NORMS[variant] = sum(p.numel() for layer in fam.layers(model) for kind, norm in
                                  (("attn", fam.attn_norm_name), ("mlp", fam.mlp_norm_name))
                                  if fam.sub_block(layer, kind) is None for p in getattr(layer, norm).parameters())
    return folders, refs


def test_export_and_reload_in_a_fresh_process(exported):
    folders, refs = exported
    code = textwrap.dedent(f"""
        import json, torch, prunelight
        from transformers import AutoModelForCausalLM
        out = {{}}
        for name, folder in {folders!r}.items():
            m = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
            tied = m.get_output_embeddings().weight.data_ptr() == m.get_input_embeddings().weight.data_ptr()
            with torch.no_grad():
                logits = m(torch.tensor({IDS.tolist()})).logits.tolist()
            out[name] = dict(cls=type(m).__name__, logits=logits, params=sum(p.numel() for p in m.parameters()),
                             tied=tied, layer_types=getattr(m.config, "layer_types", None))
        print(json.dumps(out))
        """)
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd="/")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for variant, (logits, params, tied, layer_types) in refs.items():
        g = got[variant]
        assert g["cls"].startswith(("Pruned", "NemotronNas")), variant  # auto: served layout where it states these
        torch.testing.assert_close(torch.tensor(g["logits"]), logits, atol=1e-5, rtol=1e-5)
        if g["cls"].startswith("NemotronNas"):
            params -= NOOP_NORMS[variant]
        assert g["params"] == params, f"{variant}: parameters differ after reload (a tied embedding counts once)"
        assert g["tied"] == bool(tied), f"{variant}: tie_word_embeddings={tied} but reload gave tied={g['tied']}"
        assert g["layer_types"] == layer_types


def test_tied_embeddings_are_counted_once():
    untied, tied = _model("llama"), _model("llama_tied")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert count_params(untied) - count_params(tied) == tied.lm_head.weight.numel()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lora_recovery_trains_on_the_pruned_model(variant):
    model = _model(variant)
    apply_plan(model, _plan())
    peft_model = add_lora(model, LoRASettings(r=4, alpha=8, dropout=0.0))
    family = get_family(peft_model)
    adapted = {n.split(".")[-4] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert adapted == set(family.lora_targets)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and all(
        "lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    peft_model.train()
    losses = []
    for _ in range(4):
        loss = peft_model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    peft_model.eval()
    with torch.no_grad():
        before = peft_model(IDS).logits
        merged = merge_lora(peft_model)
        torch.testing.assert_close(merged(IDS).logits, before, atol=1e-4, rtol=1e-4)


# --- Phi-3's fused projections against an unfused Llama with the same weights --------------------------
def _phi3_and_llama():
    """A tiny Phi-3 (full rotary) and the Llama holding its weights split into q/k/v and gate/up."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    phi = tiny_model("phi3", rope_parameters=rope, rms_norm_eps=1e-6)
    llama = LlamaForCausalLM(tiny_config("llama", rms_norm_eps=1e-6)).eval()
    llama.config._attn_implementation = "eager"
    state = {}
    q_rows, kv_rows, inter = 4 * 16, 2 * 16, CHANNELS
    for name, t in phi.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            q, k, v = t.split([q_rows, kv_rows, kv_rows])
            state.update({base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v})
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = t.split([inter, inter])
            state.update({base + "gate_proj.weight": gate, base + "up_proj.weight": up})
        else:
            state[name] = t
    llama.load_state_dict(state, strict=True)
    return phi, llama


def test_phi3_equals_unfused_llama_with_the_same_weights():
    phi, llama = _phi3_and_llama()
    with torch.no_grad():
        torch.testing.assert_close(phi(IDS).logits, llama(IDS).logits, atol=1e-5, rtol=1e-5)
    plan = PrunePlan([LayerPlan([1], list(range(0, CHANNELS, 3))), LayerPlan([0], list(range(50, 90)))],
                     [GROUPS] * 2, [CHANNELS] * 2)
    apply_plan(phi, plan)
    apply_plan(llama, plan)
    attn, mlp = phi.model.layers[0].self_attn, phi.model.layers[0].mlp
    assert attn.qkv_proj.out_features == (2 + 2 * 1) * 16 and mlp.gate_up_proj.out_features == 2 * 32
    with torch.no_grad():
        torch.testing.assert_close(phi(IDS).logits, llama(IDS).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("criterion", sorted(CRITERIA))
def test_fused_slices_score_like_separate_projections(criterion):
    phi, llama = _phi3_and_llama()
    batches = [IDS[:, :16], IDS[:, 8:]]
    scores = [run_calibration(m, batches, build_criterion(criterion)) for m in (phi, llama)]
    for kind in KINDS:
        for a, b in zip(scores[0][kind], scores[1][kind]):
            torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("criterion", sorted(CRITERIA))
@pytest.mark.parametrize("variant", NEW)
def test_every_criterion_scores_the_new_families(variant, criterion):
    model = _model(variant, num_hidden_layers=2)
    scores = run_calibration(model, [IDS[:, :16], IDS[:, 8:]], build_criterion(criterion))
    assert [t.numel() for t in scores["attn"]] == [GROUPS, GROUPS]
    assert [t.numel() for t in scores["mlp"]] == [CHANNELS, CHANNELS]
    assert all(torch.isfinite(t).all() for kind in KINDS for t in scores[kind])


def test_unsupported_family_gets_one_line_naming_the_supported():
    with pytest.raises(ValueError) as err:
        get_family(type("Cfg", (), {"model_type": "gpt2"})())
    message = str(err.value)
    assert "\n" not in message and "model_type='gpt2'" in message
    for name in MODEL_FAMILIES:
        assert name in message


# --- end to end: `prunelight fit` (prune, 2 LoRA steps, export) on a tiny checkpoint of every family -------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fit_prunes_recovers_and_exports(variant, tmp_path, monkeypatch):
    from prunelight.cli import cli_main
    from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

    family, overrides = VARIANTS[variant]
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", family, **overrides)
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    cli_main(tiny_fit_args(
        ckpt, files, "--data.batch_size=4", "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
        "--prune.ratio=0.25", "--export.out_dir=runs/e2e",
    ))
    out = tmp_path / "runs" / "e2e"
    report = json.loads((out / "report.json").read_text())
    assert report["params_after"] < report["params_before"]
    assert {"dense", "pruned", "recovered"} <= set(report["ppl"])
    reloaded = AutoModelForCausalLM.from_pretrained(out / "model", attn_implementation="eager")
    # auto may write the served nemotron-nas layout (Llama layers; a Mistral with no sliding window too)
    assert get_family(reloaded) is MODEL_FAMILIES["llama" if reloaded.config.model_type == "nemotron-nas" else family]
    assert count_params(reloaded) == report["params_after"]
    assert reloaded.config.tie_word_embeddings == bool(overrides.get("tie_word_embeddings",
                                                                        tiny_config(family).tie_word_embeddings))
    with torch.no_grad():
        assert torch.isfinite(reloaded(IDS[:, :16]).logits).all()
