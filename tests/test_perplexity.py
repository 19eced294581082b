"""Perplexity pinned against an independent float64 sum of cross-entropy, incl. padding and softmax underflow."""

from __future__ import annotations

import math

import pytest
import torch

from prunelight.data import TextSource, pack_blocks, tokenize_source
from prunelight.evaluation.perplexity import (
    PerplexityData,
    evaluate_perplexity,
    evaluate_perplexity_suite,
    resolve_sets,
)
from prunelight.testing import tiny_model, tiny_tokenizer, write_tiny_corpus


def _reference_nll(model, sequences: list[torch.Tensor], ignore: list[set[int]]) -> tuple[float, int]:
    """Sum of -log p(token | prefix) in float64, one unpadded sequence at a time; `ignore` = label positions."""
    total, count = 0.0, 0
    with torch.no_grad():
        for seq, skip in zip(sequences, ignore):
            logits = model(input_ids=seq[None]).logits[0].double()
            logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
            for t in range(1, len(seq)):
                if t not in skip:
                    total -= float(logp[t - 1, seq[t]])
                    count += 1
    return total, count


def _padded_batch(sequences, pad_id=0):
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask


def test_matches_independent_cross_entropy_with_padding_and_ignored_labels():
    model = tiny_model("llama", seed=3)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=gen) for n in (17, 9, 13)]
    ids, mask = _padded_batch(seqs)
    labels = ids.clone()
    labels[0, 5] = labels[2, 2] = -100  # explicitly ignored positions
    ref, count = _reference_nll(model, seqs, [{5}, set(), {2}])
    res = evaluate_perplexity(model, [{"input_ids": ids, "attention_mask": mask, "labels": labels}])
    assert res["tokens"] == count == (16 + 8 + 12) - 2  # padding and -100 labels are not scored
    assert res["nll"] == pytest.approx(ref / count, rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(ref / count), rel=1e-5)


def test_split_into_batches_is_token_weighted():
    model = tiny_model("llama", seed=1)
    blocks = torch.randint(3, 128, (5, 12), generator=torch.Generator().manual_seed(1))
    whole = evaluate_perplexity(model, [blocks])
    parts = evaluate_perplexity(model, [blocks[:1], blocks[1:]])
    assert parts["tokens"] == whole["tokens"] == 5 * 11
    assert parts["nll"] == pytest.approx(whole["nll"], rel=1e-6)


def test_softmax_underflow_stays_finite():
    model = tiny_model("llama", seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(400.0)  # logits span thousands: softmax of most tokens underflows to 0 in fp32
    seq = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(2))
    logits = model(input_ids=seq[None]).logits[0, :-1]
    probs = torch.softmax(logits, dim=-1).gather(1, seq[1:, None])
    assert (probs == 0).any(), "the test needs target tokens whose softmax probability underflows"
    ref, count = _reference_nll(model, [seq], [set()])
    res = evaluate_perplexity(model, [seq[None]])
    assert math.isfinite(res["nll"]) and res["nll"] == pytest.approx(ref / count, rel=1e-5)


def test_suite_records_lengths_and_caps_to_context(tmp_path):
    files = write_tiny_corpus(tmp_path, lines=60)
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=0)  # max_position_embeddings = 256
    src = TextSource(path=str(files["test"]))
    data = PerplexityData.build(tok, {"tiny": src}, seq_lens=[32, 2048])
    recs = evaluate_perplexity_suite(model, data, batch_size=4)
    assert [(r["seq_len_requested"], r["seq_len"]) for r in recs] == [(32, 32), (2048, 256)]
    ids = tokenize_source(tok, src)
    for r in recs:
        blocks = pack_blocks(ids, r["seq_len"])
        assert r["windows"] == len(blocks) and r["tokens"] == len(blocks) * (r["seq_len"] - 1)
        assert r["ppl"] == pytest.approx(evaluate_perplexity(model, [blocks])["ppl"], rel=1e-5)
        assert r["source"] == str(files["test"]) and r["dataset"] == "tiny"


def test_bad_inputs_fail_early():
    with pytest.raises(ValueError, match="unknown perplexity dataset 'wiki'"):
        resolve_sets(["wiki"])
    with pytest.raises(ValueError, match="seq_lens"):
        PerplexityData.build(tiny_tokenizer(), {"x": TextSource(path="x")}, seq_lens=[1])
    with pytest.raises(ValueError, match="at least one scored token"):
        evaluate_perplexity(tiny_model("llama"), [])


def test_hub_defaults_name_what_they_read():
    sets = resolve_sets(["wikitext2", "ptb", "c4"])
    assert sets["wikitext2"].describe() == "Salesforce/wikitext/wikitext-2-raw-v1:test"
    assert sets["ptb"].split == "test" and sets["c4"].split == "validation"
    assert sets["c4"].data_files.endswith("c4-validation.00000-of-00008.json.gz")  # one shard, not all of C4


def _byte_tokenizer(bos: bool):
    """A small byte-level BPE (keeps newlines, decodes losslessly); `bos`: it adds <s> by default, like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox\n\njumps over the lazy dog\n"] * 20, trainer=trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _rows(tmp_path):
    files = write_tiny_corpus(tmp_path, lines=30)
    return str(files["test"]), files["test"].read_text().splitlines()


@pytest.mark.parametrize("chunk_lines", [2000, 7])
def test_paper_protocol_one_bos_and_blank_line_joins(tmp_path, chunk_lines):
    path, rows = _rows(tmp_path)
    tok = _byte_tokenizer(bos=True)
    ids = tokenize_source(tok, TextSource(path=path, protocol="paper"), chunk_lines=chunk_lines).tolist()
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # one BOS for the whole stream
    assert tok.decode(ids[1:]) == "\n\n".join(rows)
    if chunk_lines == 2000:  # one chunk: exactly what the papers' tokenizer("\n\n".join(rows)) gives
        assert ids == tok("\n\n".join(rows))["input_ids"]


def test_paper_protocol_adds_only_what_the_tokenizer_adds(tmp_path):
    """A tokenizer that adds no BOS by default (Qwen2's) gets none: the papers' code would add none either."""
    path, rows = _rows(tmp_path)
    tok = _byte_tokenizer(bos=False)
    ids = tokenize_source(tok, TextSource(path=path, protocol="paper")).tolist()
    assert tok.bos_token_id not in ids and ids == tok("\n\n".join(rows))["input_ids"]


def test_local_files_keep_the_lines_protocol(tmp_path):
    path, rows = _rows(tmp_path)
    tok = _byte_tokenizer(bos=True)
    src = resolve_sets({"local": {"path": path}})["local"]
    assert src.protocol == "lines"
    ids = tokenize_source(tok, src).tolist()
    assert tok.bos_token_id not in ids
    assert ids == tok("\n".join(rows), add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="protocol='wanda' is not allowed: use one of lines, paper, paper_c4"):
        TextSource(path=path, protocol="wanda")


def test_hub_defaults_use_the_paper_protocol_and_records_name_it(tmp_path):
    sets = resolve_sets(["wikitext2", "ptb", "c4"])
    assert {k: v.protocol for k, v in sets.items()} == {"wikitext2": "paper", "ptb": "paper", "c4": "paper_c4"}
    path, _ = _rows(tmp_path)
    tok = tiny_tokenizer()
    data = PerplexityData.build(tok, {"lines": TextSource(path=path), "paper": TextSource(path=path, protocol="paper")},
                                seq_lens=[16], max_windows=2)
    recs = evaluate_perplexity_suite(tiny_model("llama"), data)
    assert [(r["dataset"], r["protocol"]) for r in recs] == [("lines", "lines"), ("paper", "paper")]
