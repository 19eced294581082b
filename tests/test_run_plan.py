"""The run plan: every refusal that needs no weights happens before any weights load, once.

Each bad input below is refused by `run_plan.prepare_run` from the config alone: through the CLI in-process
with the weight loader patched to fail (`prunelight.sources.load_model`), and through `prunelight.prune` with the
cut patched to fail (it is never reached). The refusals after scoring that these pre-checks make unreachable
(layerwise rates, blockwise and depth structures, channel alignment, every layer emptied) are named here.
"""

from __future__ import annotations

import json

import pytest
import torch

import prunelight
from prunelight.allocation.width import GlobalOptions
from prunelight.allocation import Shape, precheck
from prunelight.run_plan import RunFacts, RunPlan, prepare_run
from prunelight.settings import PruneSettings
from prunelight.testing import make_tiny_checkpoint, settings_of, tiny_fit_args, tiny_model, write_tiny_corpus

# (prune options, the refusal's words): each refused from model sizes alone, whatever scoring would say.
BAD = [
    ({"allocation": "layerwise", "ratio": 0.6, "allocation_args": {"rate_range": [0.0, 0.2]}}, "layer rates up to 0.2"),
    ({"allocation": "layerwise", "ratio": 0.05, "allocation_args": {"rate_range": [0.6, 1.0]}},
     "the low rate 0.6 alone removes"),
    ({"allocation": "blockwise", "ratio": 0.7, "allocation_args": {"fill_width": False}}, "whole sub-blocks give at most"),
    ({"allocation": "depth", "ratio": 0.01, "allocation_args": {"fill_width": False}}, "less than half a layer"),
    ({"allocation": "depth", "ratio": 0.9}, "can go"),
    ({"allocation": "global", "align_channels": 128}, "align_channels=128 is not allowed: it exceeds the 96"),
    ({"allocation": "global", "min_groups": 5}, "min_groups=5 is not allowed: the model's layers have 2 KV groups"),
]


def _cli_options(options: dict) -> list[str]:
    out = []
    for key, value in options.items():
        if isinstance(value, dict):
            out.append(f"--prune.{key}={json.dumps(value)}")
        else:
            out.append(f"--prune.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


@pytest.fixture
def no_weights(monkeypatch):
    """Loading any weights fails the test: refusals must come from configs alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr("prunelight.sources.load_model", refuse)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_plan")
    return make_tiny_checkpoint(root / "ckpt"), write_tiny_corpus(root / "data"), root


def _fit(job, *extra: str):
    from prunelight.cli import cli_main

    ckpt, files, root = job
    return cli_main(tiny_fit_args(ckpt, files, "--model.recovery=none", "--prune.criterion=magnitude",
                                  "--prune.reconstruct=none", "--trainer.enable_progress_bar=false",
                                  f"--export.out_dir={root / 'runs'}", *extra))


@pytest.mark.parametrize("options,words", BAD, ids=[f"{o['allocation']}-{w.split()[0]}" for o, w in BAD])
def test_the_cli_refuses_before_any_weights_load(no_weights, job, options, words):
    with pytest.raises(ValueError, match=words):
        _fit(job, *_cli_options(options))


@pytest.mark.parametrize("options,words", BAD, ids=[f"{o['allocation']}-{w.split()[0]}" for o, w in BAD])
def test_prune_refuses_before_any_scoring(monkeypatch, options, words):
    def refuse(*args, **kwargs):
        raise AssertionError("the cut started before the refusal")

    monkeypatch.setattr("prunelight.api.run_cut", refuse)
    calibration = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=words):
        prunelight.prune(tiny_model(), {"criterion": "magnitude", "reconstruct": "none", **options}, calibration)


@pytest.mark.parametrize("extra,words", [
    (["--export.format=stock", "--prune.min_channels=0"], "min_channels=0 is not allowed with export.format=stock"),
    (["--export.format=nemotron_nas", "--prune.reconstruct=bias"], "reconstruct='bias' is not allowed"),
    (["--export.format=stock", "--prune.allocation=layerwise"], "is not allowed with export.format=stock"),
    (["--trainer.max_steps=2", "--model.recovery=lora", "--prune.prune_step=5"], "prune_step=5 is not allowed"),
])
def test_shape_and_run_refusals_come_before_any_weights(no_weights, job, extra, words):
    with pytest.raises(ValueError, match=words):
        _fit(job, *extra)


def test_a_teacher_with_another_vocabulary_is_refused_before_any_weights(no_weights, job, tmp_path):
    teacher = make_tiny_checkpoint(tmp_path / "teacher", vocab_size=256)
    with pytest.raises(ValueError, match=r"model.distillation.teacher=.* its vocabulary has 256 tokens, the model's "
                                         r"128"):
        _fit(job, "--model.recovery=lora", f"--model.distillation.teacher={teacher}", "--trainer.max_steps=2")


def test_zero3_with_a_measuring_allocation_is_refused_from_the_config():
    """The default allocation's probes are masked forwards: ZeRO-3 is refused by the plan, naming the way out."""
    config = tiny_model().config
    with pytest.raises(ValueError, match="ZeRO-3.*allocation=search.*prune.allocation: global"):
        prepare_run(PruneSettings(reconstruct="none"), config=config, run=RunFacts(deepspeed=True, zero_stage=3))
    plan = prepare_run(settings_of(0.2, reconstruct="none"), config=config, run=RunFacts(deepspeed=True, zero_stage=3))
    assert plan.budget is not None and plan.row.name == "global"


def _count_checks(monkeypatch) -> dict[str, int]:
    """Count make_budget and check_shape calls wherever the package reaches them."""
    import prunelight.allocation as allocation
    import prunelight.run_plan as run_plan

    calls = {"make_budget": 0, "check_shape": 0}

    def counted(name, module, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted("make_budget", allocation, allocation.make_budget)
    counted("check_shape", run_plan, run_plan.check_shape)
    counted("check_shape", allocation, allocation.check_shape)
    return calls


def test_prune_makes_the_budget_and_checks_the_shape_once(monkeypatch):
    """The cut takes the plan's budget as it is, also through the split search's many allocations."""
    calls = _count_checks(monkeypatch)
    calibration = torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    model, plan = prunelight.prune(tiny_model(), {"criterion": "magnitude", "allocation": "calibrated",
                                                  "attn_mlp_split": "auto", "reconstruct": "none"}, calibration)
    assert calls == {"make_budget": 1, "check_shape": 1}
    assert plan.meta["allocation"] == "calibrated" and plan.meta["split_search"]["tried"]


def test_a_cli_run_makes_the_budget_and_checks_the_shape_once(monkeypatch, job):
    calls = _count_checks(monkeypatch)
    cli = _fit(job, "--trainer.fast_dev_run=true", "--prune.allocation=global", "--export.format=stock")
    assert cli.model.plan is not None and cli.job_callbacks[0].run_plan.budget is not None
    assert calls == {"make_budget": 1, "check_shape": 1}


def test_a_saved_plan_has_no_budget_and_a_free_plan_counts_the_twin():
    config = tiny_model().config
    plan = prepare_run(settings_of(0.2), Shape.FREE, config)
    assert isinstance(plan, RunPlan) and plan.options == GlobalOptions()
    assert plan.budget.total == precheck(tiny_model(), settings_of(0.2)).total  # the twin counts the real sizes
    assert prepare_run(settings_of(0.2)).budget is None  # no config: settings and run facts only


def test_every_layer_emptied_is_refused_from_sizes():
    """min_groups = min_channels = 0 with a ratio whose removal may reach every unit of every layer (the fills land
    within one channel, aligned ones within 32 channels, above the target): refused before scoring."""
    model = tiny_model()
    units = sum(p.numel() for layer in model.model.layers for p in (*layer.self_attn.parameters(),
                                                                     *layer.mlp.parameters()))
    channel = 3 * model.config.hidden_size  # gate, up and down rows of one MLP channel
    ratio = (units - 2 * channel) / sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="would remove every unit of every decoder layer"):
        precheck(model, settings_of(ratio, min_groups=0, min_channels=0, align_channels=32))
    precheck(model, settings_of(ratio, min_groups=0, min_channels=0))  # one channel of overshoot leaves the norms


def test_a_cut_on_a_gpu_with_unaligned_widths_says_how_to_align_them():
    """On CUDA, widths not in multiples of 8 get one line naming prune.align_channels; elsewhere, or aligned, none."""
    from prunelight.cut import alignment_advice
    from prunelight.settings import PruneSettings

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    line = alignment_advice(cuda, PruneSettings(align_channels=1))
    assert line and "prune.align_channels=1" in line and "prune.align_channels: 128" in line
    assert "prune.align_channels=12" in alignment_advice(cuda, PruneSettings(align_channels=12))
    assert alignment_advice(cuda, PruneSettings(align_channels=8)) is None
    assert alignment_advice(cuda, PruneSettings(align_channels=128)) is None
    assert alignment_advice(cpu, PruneSettings(align_channels=1)) is None
    assert alignment_advice(cuda, PruneSettings(align_channels=1, plan="plan.json")) is None
