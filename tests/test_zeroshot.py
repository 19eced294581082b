"""Local zero-shot tasks through lm-eval on a tiny model, offline, checked against hand-computed log-likelihoods."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from prunelight.evaluation.zeroshot import TASKS, acc_stderr, evaluate_zeroshot, local_task_config, mean_stderr
from prunelight.testing import tiny_model, tiny_tokenizer

ARC_ROWS = [
    {"query": "Question: which fox is quick", "choices": ["the brown fox", "a lazy dog", "low rank"], "gold": 0},
    {"query": "Question: what is shared among query heads", "choices": ["one key", "the dog", "value head"], "gold": 2},
    {"query": "Question: we remove whole groups", "choices": ["then recover", "channels", "the quick"], "gold": 1},
    {"query": "Question: a model that is pruned", "choices": ["must still speak", "jumps over"], "gold": 0},
]
WINO_ROWS = [
    {"context_options": ["the quick fox", "the lazy dog"], "continuation": "jumps over the model.", "gold": 0},
    {"context_options": ["we remove groups", "we recover heads"], "continuation": "with low rank adapters.", "gold": 1},
]


def _write(folder, name, rows):
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _loglikelihood(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | context), tokenized as lm-eval does (the pair encoded whole, context split off)."""
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return float(sum(logp[t - 1, whole[t]] for t in range(n_ctx, len(whole))))


@pytest.fixture(scope="module")
def tiny_lm():
    return tiny_model("llama", seed=5), tiny_tokenizer()


def test_local_arc_task_matches_hand_computation(tmp_path, tiny_lm):
    model, tok = tiny_lm
    _write(tmp_path, "arc_easy", ARC_ROWS)
    res = evaluate_zeroshot(model, tok, ["arc_easy"], data_dir=tmp_path, batch_size=4, log_samples=True)
    row = res["tasks"]["arc_easy"]
    hand_acc, hand_norm = [], []
    for doc in ARC_ROWS:
        ctx = doc["query"] + "\nAnswer:"
        lls = [_loglikelihood(model, tok, ctx, " " + c) for c in doc["choices"]]
        hand_acc.append(int(max(range(len(lls)), key=lls.__getitem__) == doc["gold"]))
        norm = [ll / len(" " + c) for ll, c in zip(lls, doc["choices"])]  # lm-eval normalises by characters
        hand_norm.append(int(max(range(len(norm)), key=norm.__getitem__) == doc["gold"]))
        logged = next(s for s in row["samples_log"] if s["doc"]["query"] == doc["query"])
        assert [r[0][0] for r in logged["resps"]] == pytest.approx(lls, abs=1e-3)
    assert row["acc"] == pytest.approx(sum(hand_acc) / len(ARC_ROWS))
    assert row["acc_norm"] == pytest.approx(sum(hand_norm) / len(ARC_ROWS))
    assert row["samples"] == len(ARC_ROWS) and row["version"] == 1.0
    assert res["lm_eval_version"] and res["mode"] == "local"
    assert res["average"]["acc"] == row["acc"]
    # Binomial standard error of the hand-computed accuracy (lm-eval's mean_stderr of the 0/1 scores).
    p, n = sum(hand_acc) / len(hand_acc), len(hand_acc)
    assert row["acc_stderr"] == pytest.approx(statistics.stdev(hand_acc) / n**0.5)
    assert row["acc_stderr"] == pytest.approx((p * (1 - p) / (n - 1)) ** 0.5)
    assert res["average"]["acc_stderr"] == pytest.approx(row["acc_stderr"])


def test_average_stderr_combines_independent_tasks():
    assert mean_stderr([0.03, 0.04]) == pytest.approx(0.05 / 2)
    assert mean_stderr([0.03, None]) is None
    assert acc_stderr(0.5, 1) is None and acc_stderr(0.5, 101) == pytest.approx(0.05)


def test_winogrande_scores_shared_continuation_under_each_context(tmp_path, tiny_lm):
    model, tok = tiny_lm
    _write(tmp_path, "winogrande", WINO_ROWS)
    res = evaluate_zeroshot(model, tok, ["winogrande"], data_dir=tmp_path, batch_size=2, limit=2)
    hand = []
    for doc in WINO_ROWS:
        lls = [_loglikelihood(model, tok, c, " " + doc["continuation"]) for c in doc["context_options"]]
        hand.append(int(max(range(2), key=lls.__getitem__) == doc["gold"]))
    assert res["tasks"]["winogrande"]["acc"] == pytest.approx(sum(hand) / len(hand))
    assert "acc_norm" not in res["tasks"]["winogrande"]


def test_hellaswag_uses_standard_preprocessing(tmp_path):
    doc = {"activity_label": "Pole vault", "ctx_a": "A man runs.", "ctx_b": "he [title] jumps", "ctx": "",
           "endings": ["over the bar [step] now.", "b", "c", "d"], "label": "0"}
    _write(tmp_path, "hellaswag", [doc])
    cfg = local_task_config("hellaswag", tmp_path)
    from datasets import Dataset

    out = cfg["process_docs"](Dataset.from_list([doc]))[0]
    assert out["query"] == "Pole vault: A man runs. He. jumps" and out["choices"][0] == "over the bar now."
    assert out["gold"] == 0


def test_bad_task_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown zero-shot task 'mmlu'"):
        local_task_config("mmlu", tmp_path)
    with pytest.raises(FileNotFoundError, match="boolq"):
        local_task_config("boolq", tmp_path)
    assert set(TASKS) == {"boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa"}
