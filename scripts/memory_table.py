"""On-paper GPU memory for scoring, LoRA recovery and full recovery (Markdown table).

    python scripts/memory_table.py                         # Llama-3-8B and -70B (built-in numbers)
    python scripts/memory_table.py --model path/or/hub-id  # any GQA config transformers can read
    python scripts/memory_table.py --seq-len 4096 --gpus 16 --ratio 0.3 --lora-r 32

Counts are estimates from the architecture alone (no weights are loaded: `prunelight.bench.architecture` counts
a meta-device copy as a run counts it, with the family's own unit costs): bf16 weights, fp32
per-unit statistics, bf16 activations kept for backward (with and without gradient
checkpointing), fp32 logits for the loss, and mixed-precision AdamW states (fp32 master weights,
m and v: 12 bytes per trained parameter, plus its 2-byte gradient; LoRA adapters train in fp32:
16 bytes each). Allocator fragmentation, CUDA context (~0.5-1 GiB) and communication buffers are
not included; leave 10-20% headroom.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from prunelight import bench

GIB = 1024**3

# Published config.json numbers (meta-llama/Meta-Llama-3-8B and -70B); no hub access needed.
BUILTIN = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                      tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256,
                       tie_word_embeddings=False),
}


@dataclass
class Arch:
    """What memory depends on: a model's counts (`bench.architecture`: the `Budget` of a run with this ratio, the
    family's LoRA targets, tied embeddings once); activations use the first layer's widths."""

    name: str
    counts: bench.Architecture

    @property
    def layers(self) -> int:
        """Decoder layers."""
        return self.counts.layers

    def keep(self) -> float:
        """Width fraction of the scored units (GQA groups and MLP channels) the ratio's cut leaves."""
        return 1 - self.counts.params_removed / self.counts.unit_params

    def params(self, pruned: bool = False) -> float:
        """All parameters, dense or after the ratio's cut (embeddings and head are never pruned)."""
        return self.counts.params - (self.counts.params_removed if pruned else 0)

    def lora_params(self, r: int, keep: float = 1.0) -> float:
        """LoRA adapter parameters on the family's target projections of every layer, rank r (the cut side of each
        projection shrinks with the width)."""
        return sum(r * (fixed + keep * cut) for fixed, cut in self.counts.lora_shapes)

    def units(self) -> int:
        """Scored units: one per GQA group and per MLP channel."""
        return self.counts.units

    def act_per_token_layer(self, keep: float = 1.0) -> float:
        """bf16 bytes autograd keeps per token in one layer (norm in/out, q/k/v and rotary copies,
        attention output, o_proj input, residual, gate/up outputs, SiLU and product): fused attention."""
        c = self.counts
        q, kv, i = keep * c.heads * c.head_dim, keep * c.kv_heads * c.head_dim, keep * c.intermediate
        return 2 * (6 * c.hidden + 3 * q + 4 * kv + 4 * i)


def arch(name: str, ratio: float) -> Arch:
    """The Arch of a built-in model or of a transformers config (local folder or hub id); no weights are loaded."""
    from transformers import AutoConfig

    if name in BUILTIN:
        spec = dict(BUILTIN[name])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    else:
        config = AutoConfig.from_pretrained(name)
    a = Arch(name, bench.architecture(config, ratio))  # shapes only: a 70B model costs nothing here
    if a.keep() <= 0:
        raise ValueError(f"--ratio {ratio} removes more than the decoder layers' GQA groups and MLP channels hold")
    return a


def components(a: Arch, seq: int, batch: int, ratio: float, r: int) -> dict[str, float]:
    """Bytes of each memory component for one model copy (not yet divided over GPUs)."""
    keep, c = a.keep(), a.counts
    tokens = seq * batch
    logits = tokens * c.vocab * 4 * 2  # fp32 logits and their log-softmax / gradient
    p_dense, p_pruned = a.params(), a.params(pruned=True)
    lora = a.lora_params(r, keep)
    return {
        "weights_dense_bf16": 2 * p_dense,
        "weights_pruned_bf16": 2 * p_pruned,
        "statistics_fp32": 4 * a.units(),
        "act_scoring_no_ckpt": tokens * a.layers * a.act_per_token_layer() + logits,
        "act_scoring_ckpt": tokens * (a.layers * 2 * c.hidden + a.act_per_token_layer()) + logits,
        # activation-gradient criteria (taylor, fisher, ...) read each unit's output at o_proj/down_proj input; under
        # checkpointing that tensor is held, not recomputed, for every layer (seen on an H100: 21.2 GiB peak for
        # Llama-3-8B taylor at 2048 tokens, 17.8 on paper without it)
        "held_unit_outputs_ckpt": tokens * a.layers * 2 * (c.heads * c.head_dim + c.intermediate),
        "act_recovery_ckpt": tokens * (a.layers * 2 * c.hidden + a.act_per_token_layer(keep)) + logits,
        "lora_params": lora,
        "lora_train_state": 16 * lora,  # fp32 weight + grad + Adam m, v
        "full_grads_bf16": 2 * p_pruned,
        "full_optimizer_fp32": 12 * p_pruned,  # master weights + Adam m, v
        "one_layer_gathered": 2 * c.layer_params,
        "params_dense": p_dense,
        "params_pruned": p_pruned,
    }


def per_gpu(c: dict[str, float], gpus: int) -> list[tuple[str, float, float, float]]:
    """(setting, scoring, LoRA recovery, full recovery) bytes per GPU."""
    score_1 = c["weights_dense_bf16"] + c["act_scoring_ckpt"] + c["held_unit_outputs_ckpt"] + c["statistics_fp32"]
    lora_1 = c["weights_pruned_bf16"] + c["lora_train_state"] + c["act_recovery_ckpt"]
    full_1 = c["weights_pruned_bf16"] + c["full_grads_bf16"] + c["full_optimizer_fp32"] + c["act_recovery_ckpt"]
    rows = [("1 GPU", score_1, lora_1, full_1), (f"DDP x{gpus}", score_1, lora_1, full_1)]
    # ZeRO-2: gradients and optimizer states partitioned, weights replicated.
    rows.append((
        f"ZeRO-2 x{gpus}",
        score_1,
        c["weights_pruned_bf16"] + c["lora_train_state"] / gpus + c["act_recovery_ckpt"],
        c["weights_pruned_bf16"] + (c["full_grads_bf16"] + c["full_optimizer_fp32"]) / gpus + c["act_recovery_ckpt"],
    ))
    # ZeRO-3: weights partitioned too; one layer is gathered at a time (x2 for prefetch).
    gather = 2 * c["one_layer_gathered"]
    rows.append((
        f"ZeRO-3 x{gpus}",
        c["weights_dense_bf16"] / gpus + gather + c["act_scoring_ckpt"] + c["held_unit_outputs_ckpt"]
        + c["statistics_fp32"],
        c["weights_pruned_bf16"] / gpus + gather + c["lora_train_state"] / gpus + c["act_recovery_ckpt"],
        (c["weights_pruned_bf16"] + c["full_grads_bf16"] + c["full_optimizer_fp32"]) / gpus + gather
        + c["act_recovery_ckpt"],
    ))
    return rows


def render(a: Arch, seq: int, batch: int, ratio: float, r: int, gpus: int) -> str:
    """Markdown: the components of one model, then per-GPU totals."""
    c = components(a, seq, batch, ratio, r)
    g = lambda x: f"{x / GIB:,.1f}"
    lines = [
        f"### {a.name}: {c['params_dense'] / 1e9:.2f}B parameters, {c['params_pruned'] / 1e9:.2f}B after "
        f"removing {ratio:.0%} of all parameters; {batch} x {seq} tokens per step, LoRA r={r}",
        "",
        "| component | GiB |",
        "|---|---:|",
        f"| weights, bf16 (dense) | {g(c['weights_dense_bf16'])} |",
        f"| weights, bf16 (pruned) | {g(c['weights_pruned_bf16'])} |",
        f"| importance statistics, fp32 ({a.units():,} units) | {c['statistics_fp32'] / 2**20:.2f} MiB |",
        f"| activations while scoring, no checkpointing | {g(c['act_scoring_no_ckpt'])} |",
        f"| activations while scoring, gradient checkpointing | {g(c['act_scoring_ckpt'])} |",
        f"| unit outputs held for activation-gradient criteria (taylor, fisher), checkpointing "
        f"| {g(c['held_unit_outputs_ckpt'])} |",
        f"| activations while recovering (pruned), checkpointing | {g(c['act_recovery_ckpt'])} |",
        f"| LoRA: {c['lora_params'] / 1e6:,.0f}M adapter parameters, weights+grads+AdamW fp32 "
        f"| {g(c['lora_train_state'])} |",
        f"| full recovery: bf16 gradients | {g(c['full_grads_bf16'])} |",
        f"| full recovery: AdamW fp32 master + m + v | {g(c['full_optimizer_fp32'])} |",
        "| weight gradients while scoring (weights frozen) | 0 |",
        "",
        "| per GPU | scoring | LoRA recovery | full recovery |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {g(s)} | {g(lo)} | {g(fu)} |" for name, s, lo, fu in per_gpu(c, gpus)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Print the table for the built-in Llama-3 models or for `--model`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help=f"built-in ({', '.join(BUILTIN)}), local folder or hub id")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--ratio", type=float, default=0.2, help="fraction of parameters removed")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--gpus", type=int, default=8, help="GPUs the job is spread over")
    args = p.parse_args(argv)
    if not 0 <= args.ratio < 1:
        p.error(f"--ratio must be in [0, 1), got {args.ratio}")
    for name in args.model or list(BUILTIN):
        print(render(arch(name, args.ratio), args.seq_len, args.batch, args.ratio, args.lora_r, args.gpus))


if __name__ == "__main__":
    main()
