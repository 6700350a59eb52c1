"""Issue 36, acceptance 5: EleutherAI's lm-eval harness (the real ``lm_eval`` package) against
``blitz serve`` on SmolLM2 (float32, as the ``smollm2_llm`` engine it is compared with), on two
small tasks written here (YAML + a local JSON file, no hub):

- a multiple-choice task (loglikelihood): ``local-completions`` sends each (context,
  continuation) as token ids with ``echo``, ``logprobs`` 1 and ``max_tokens`` 1, several prompts
  per request, and reads the prompt tokens' logprobs;
- a generate-until task: ``local-completions`` (token-id prompts, ``stop``) and
  ``local-chat-completions`` (messages through the chat template).

The harness's per-item results equal the engine's Python API run directly on the same items:
each continuation's summed logprob (from ``prompt_logprobs``, within 1e-4) and whether it is the
greedy one, each generated text exactly, and so the scores."""
from __future__ import annotations

import json
import math

import pytest

from blitzllm import SamplingParams

lm_eval = pytest.importorskip("lm_eval")

MC = [("What is the capital of France?", ["Paris", "London", "Rome"], 0),
      ("How many legs does a spider have?", ["six", "eight", "ten"], 1),
      ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars"], 2),
      ("What color is the sky on a clear day?", ["blue", "green", "red"], 0),
      ("What is two plus two?", ["three", "five", "four"], 2),
      ("Which animal says moo?", ["a cow", "a cat", "a dog"], 0),
      ("What do bees make?", ["milk", "honey", "silk"], 1),
      ("What is frozen water called?", ["steam", "ice", "sand"], 1),
      ("Which is the largest ocean?", ["the Pacific", "the Arctic", "the Indian"], 0),
      ("What do you use to write on paper?", ["a spoon", "a pen", "a shoe"], 1)]
GEN = [("Complete: one, two, three,", "four"), ("The opposite of hot is", "cold"),
       ("The first month of the year is", "January"), ("Water is made of hydrogen and", "oxygen"),
       ("The color of grass is", "green"), ("A week has seven", "days")]
MAX_GEN = 6


def _write_tasks(folder) -> None:
    with open(folder / "mc.jsonl", "w") as f:
        for q, choices, answer in MC:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for prompt, target in GEN:
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        f"task: blitz_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "gen.yaml").write_text(
        f"task: blitz_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \" {{target}}\"\n"
        f"generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def harness(tmp_path_factory, smollm2_llm, monkeypatch_module):
    """(the task folder, the tokenizer folder lm-eval loads: the served model's own tokenizer)."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    _write_tasks(folder)
    tok = folder / "tokenizer"
    smollm2_llm.tokenizer.save_pretrained(str(tok))
    for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "HF_DATASETS_CACHE": str(folder / "datasets-cache")}.items():
        monkeypatch_module.setenv(k, v)
    return folder, tok


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _evaluate(model: str, model_args: dict, task: str, folder, **kw) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    return simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                           task_manager=TaskManager(include_path=str(folder), include_defaults=False), **kw)


def _chat_prompt(arguments) -> str:
    """A logged sample's chat prompt (JSON text): lm-eval nests it in one-element tuples, to a
    depth and in a wrapper (``JsonChatStr``) that vary between its code paths."""
    while isinstance(arguments, (tuple, list)):
        arguments = arguments[0]
    return getattr(arguments, "prompt", arguments)


def _by_doc(res: dict, task: str) -> list:
    return sorted(res["samples"][task], key=lambda s: s["doc_id"])


def test_lm_eval_loglikelihood_matches_the_engine(smol_f32_server, smollm2_llm, harness):
    folder, tok = harness
    args = {"base_url": smol_f32_server.url + "/v1/completions", "model": "smollm2", "tokenizer": str(tok),
            "tokenizer_backend": "huggingface", "batch_size": 16, "max_retries": 1, "timeout": 600}
    res = _evaluate("local-completions", args, "blitz_mc", folder)
    samples = _by_doc(res, "blitz_mc")
    assert len(samples) == len(MC)
    # the engine's Python API on the same items: context and continuation tokenized as lm-eval
    # does (the whole text, the context alone, the continuation = the rest)
    tokenizer = smollm2_llm.tokenizer
    items, ctxlens = [], []
    for s in samples:
        for context, continuation in s["arguments"]:
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            items.append(whole)
            ctxlens.append(len(tokenizer(context, add_special_tokens=False).input_ids))
    outs = smollm2_llm.generate(items, SamplingParams(prompt_logprobs=1, max_tokens=0))
    correct = 0
    k = 0
    for s, (_, _, answer) in zip(samples, MC):
        got = [r[0] for r in s["resps"]]   # per choice: [(loglikelihood, is_greedy)]
        ref = []
        for _ in s["arguments"]:
            ids, plp, c = items[k], outs[k].prompt_logprobs, ctxlens[k]
            ll = sum(plp[p][ids[p]] for p in range(c, len(ids)))
            greedy = all(ids[p] == max(plp[p], key=plp[p].get) for p in range(c, len(ids)))
            ref.append((ll, greedy))
            k += 1
        for (gl, gg), (rl, rg) in zip(got, ref):
            assert math.isclose(gl, rl, abs_tol=1e-4), (s["doc_id"], gl, rl)
            assert gg == rg
        correct += max(range(len(ref)), key=lambda i: ref[i][0]) == answer
    assert res["results"]["blitz_mc"]["acc,none"] == pytest.approx(correct / len(MC))
    assert smollm2_llm.stats()["kv_blocks_free"] == smollm2_llm.stats()["kv_blocks_total"]


def _reference_generations(llm, prompts: list) -> list:
    """Greedy, at most MAX_GEN tokens, cut at lm-eval's stops (the server's stop strings)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_GEN, stop=["\n", "."], seed=1234))
    return [o.text for o in outs]


def test_lm_eval_generate_until_matches_the_engine(smol_f32_server, smollm2_llm, harness):
    folder, tok = harness
    url = smol_f32_server.url
    res = _evaluate("local-completions", {"base_url": url + "/v1/completions", "model": "smollm2", "tokenizer": str(tok),
                                          "tokenizer_backend": "huggingface", "max_retries": 1, "timeout": 600},
                    "blitz_gen", folder)
    samples = _by_doc(res, "blitz_gen")
    want = _reference_generations(smollm2_llm, [smollm2_llm.tokenizer(p, add_special_tokens=False).input_ids
                                                for p, _ in GEN])
    assert [s["resps"][0][0] for s in samples] == want
    score = sum(w == " " + t for w, (_, t) in zip(want, GEN)) / len(GEN)   # (the task's target: " {{target}}")
    assert res["results"]["blitz_gen"]["exact_match,none"] == pytest.approx(score)

    chat = _evaluate("local-chat-completions", {"base_url": url + "/v1/chat/completions", "model": "smollm2",
                                                "max_retries": 1, "timeout": 600}, "blitz_gen", folder,
                     apply_chat_template=True)
    samples = _by_doc(chat, "blitz_gen")
    messages = [json.loads(_chat_prompt(s["arguments"])) for s in samples]
    assert [m[-1]["content"] for m in messages] == [p for p, _ in GEN]
    want = _reference_generations(smollm2_llm, [smollm2_llm.apply_chat_template(m) for m in messages])
    assert [s["resps"][0][0] for s in samples] == want
