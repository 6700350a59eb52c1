"""EAGLE-3 head (blitzllm/spec/eagle3.py) and `blitz train-draft` (spec/train_draft.py):
shapes, save/load, hidden-state capture from the engine's own forward equals the
transformers oracle's hidden states, and online training learns a repetitive corpus."""
import json

import pytest
import torch

from blitzllm import LLM
from blitzllm.cli import main
from blitzllm.cli.train_draft import evaluate_head
from blitzllm.spec.eagle3 import Eagle3Config, Eagle3Head, default_layer_ids
from blitzllm.spec.hidden import HiddenCapture
from blitzllm.spec.train_draft import (Sample, capture_features, load_prompts, make_optimizer, parse_range,
                                       sample_loss, train_on)

from tests.conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """4 layers, so three distinct un-normed layer outputs exist (HF's last hidden state is
    after the final norm)."""
    path = tmp_path_factory.mktemp("tiny-llama-4l")
    model = make_tiny_checkpoint("llama", path, seed=3, num_hidden_layers=4)
    llm = LLM(str(path), device="cpu", kv_cache_blocks=128, enable_prefix_caching=False, max_num_seqs=4,
              max_num_batched_tokens=16)
    return llm, model


def _record_proposals(llm) -> list:
    """Wrap the engine's EAGLE-3 proposer: the returned list fills with (the request's token
    ids, its drafts) at every propose call."""
    prop = llm.engine.spec.proposer
    calls, propose = [], prop.propose

    def recording(reqs, limits):
        res = propose(reqs, limits)
        calls.extend((list(r.all_token_ids), list(d)) for r, d in zip(reqs, res.drafts))
        return res
    prop.propose = recording
    return calls


def _head(llm, layer_ids=(0, 1, 2)) -> Eagle3Head:
    torch.manual_seed(0)
    return Eagle3Head.from_target(llm.engine.runner.model, llm.engine.model_config, list(layer_ids))


def test_default_layer_ids():
    assert default_layer_ids(30) == [1, 14, 26]
    assert default_layer_ids(2) == [1, 0, 0]


def test_head_shapes_and_step_mask(tiny4):
    llm, _ = tiny4
    head = _head(llm)
    c = head.config
    T, steps = 9, 3
    feats = torch.randn(T, 3 * c.target_hidden_size)
    tokens = torch.randint(0, c.vocab_size, (T + steps,))
    with torch.no_grad():
        outs = head.forward_steps(feats, tokens, steps)
        assert len(outs) == steps and all(o.shape == (T, c.hidden_size) for o in outs)
        assert head.logits(outs[0]).shape == (T, c.vocab_size)
        # causal: rows < 5 do not depend on features / tokens of later rows, at any step
        feats2, tokens2 = feats.clone(), tokens.clone()
        feats2[5:] += 1.0
        tokens2[5 + steps:] = (tokens2[5 + steps:] + 1) % c.vocab_size
        outs2 = head.forward_steps(feats2, tokens2, steps)
    for o, o2 in zip(outs, outs2):
        torch.testing.assert_close(o[:5], o2[:5])
        assert not torch.allclose(o[5:], o2[5:])


def test_save_load_round_trip(tiny4, tmp_path):
    llm, _ = tiny4
    head = _head(llm)
    with torch.no_grad():
        head.fc.weight.add_(0.01)   # not just the init
    head.save(str(tmp_path / "h"))
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["layer_ids"] == [0, 1, 2] and cfg["architecture"] == "Eagle3DraftHead"
    with pytest.raises(ValueError, match="load it with its target"):
        Eagle3Head.load(str(tmp_path / "h"))   # the embedding and lm_head are the target's
    eng = llm.engine
    back = Eagle3Head.load(str(tmp_path / "h"), target=eng.runner.model, target_cfg=eng.model_config)
    assert back.config == head.config
    feats = torch.randn(6, 3 * head.config.target_hidden_size)
    tokens = torch.randint(0, head.config.vocab_size, (8,))
    with torch.no_grad():
        a, b = head.forward_steps(feats, tokens, 2), back.forward_steps(feats, tokens, 2)
    for x, y in zip(a, b):
        torch.testing.assert_close(head.logits(x), back.logits(y))
    with pytest.raises(ValueError, match="EAGLE-3 head folder"):
        Eagle3Head.load(str(tmp_path))


def test_capture_equals_hf_hidden_states(tiny4):
    """Features recorded by hooks during the engine's own prefill (split into chunks by a
    small token budget) equal transformers' per-layer hidden states."""
    llm, hf = tiny4
    ids = torch.randint(1, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with HiddenCapture(llm.engine.runner.model, [2, 0, 1]) as cap:
        s = capture_features(llm, cap, ids, prompt_len=5)
    assert s.feats.shape == (36, 3 * 64)
    with torch.no_grad():
        hs = hf(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[3][0], hs[1][0], hs[2][0]], -1)   # hidden_states[i + 1] = output of layer i
    torch.testing.assert_close(s.feats, ref, atol=2e-4, rtol=1e-4)
    # hooks are gone after the block
    assert not any(m._forward_hooks for m in llm.engine.runner.model.model.layers)


def _soft_terms(head, s, outs, n, label_logits, draft_ids=None):
    """By hand: per draft step the soft cross-entropy against softmax(label_logits(final
    rows)) and (agreeing rows, rows), where a row agrees when its draft (as a target id via
    ``draft_ids``) is the argmax of the full target logits ``head.lm_head`` had at build time."""
    terms, agree = [], []
    for j, o in enumerate(outs):
        rows = torch.arange(n - 2)
        keep = (rows + 2 + j < n) & (rows + 2 + j >= s.prompt_len)
        fin = s.final[(rows + 1 + j)[keep] - (s.prompt_len - 1)].float()
        full, p = label_logits(fin)
        with torch.no_grad():
            lg = head.logits(o[keep])
        drafts = lg.argmax(-1) if draft_ids is None else draft_ids[lg.argmax(-1)]
        terms.append(float(-(p * torch.log_softmax(lg, -1)).sum(-1).mean()))
        agree.append((int((drafts == full.argmax(-1)).sum()), int(keep.sum())))
    return terms, agree


def test_capture_keeps_target_outputs_and_soft_labels(tiny4):
    """With keep_final the capture also keeps the model's outputs of the answer positions:
    their logits are transformers' logits there; the soft-label loss is the cross-entropy
    against those distributions and counts agreement with their argmax."""
    llm, hf = tiny4
    ids = torch.randint(1, 320, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    head = _head(llm)
    with HiddenCapture(llm.engine.runner.model, head.config.layer_ids, keep_final=True) as cap:
        s = capture_features(llm, cap, ids, prompt_len=9)
    assert s.final.shape == (30 - 9, 64)   # positions 8..28 predict answer tokens 9..29
    with torch.no_grad():
        ref = hf(torch.tensor([ids[:-1]])).logits[0, 8:]
        ours = head.lm_head(s.final.float())
    torch.testing.assert_close(ours, ref, atol=0.05, rtol=0.02)   # outputs kept in bf16
    with torch.no_grad():
        loss, stats = sample_loss(head, s, 2)
        outs = head.forward_steps(s.feats[:28], torch.tensor(ids[1:] + [0, 0]), 2)
    def labels(fin):
        with torch.no_grad():
            full = head.lm_head(fin)
        return full, torch.softmax(full, -1)
    terms, agree = _soft_terms(head, s, outs, 30, labels)
    assert float(loss) == pytest.approx(terms[0] + 0.8 * terms[1], rel=1e-5)   # default step decay 0.8
    assert stats == agree
    with torch.no_grad():
        loss5, _ = sample_loss(head, s, 2, step_decay=0.5)
    assert float(loss5) == pytest.approx(terms[0] + 0.5 * terms[1], rel=1e-5)


def test_training_learns_repetitive_corpus(tiny4):
    llm, _ = tiny4
    head = _head(llm)
    opt = make_optimizer(head, 3e-3)
    g = torch.Generator().manual_seed(2)
    samples = []
    with HiddenCapture(llm.engine.runner.model, head.config.layer_ids) as cap:
        for _ in range(3):
            pattern = torch.randint(1, 320, (7,), generator=g).tolist()
            samples.append(capture_features(llm, cap, pattern * 6, prompt_len=1))

    def evaluate():
        with torch.no_grad():
            res = [sample_loss(head, s, 2) for s in samples]
        loss = sum(float(r[0]) for r in res) / len(res)
        acc = sum(r[1][0][0] for r in res) / sum(r[1][0][1] for r in res)
        return loss, acc

    loss0, acc0 = evaluate()
    for _ in range(15):
        for s in samples:
            train_on(head, opt, s, 2)
    loss1, acc1 = evaluate()
    assert loss1 < 0.3 * loss0
    assert acc1 > 0.9 > acc0 + 0.3


def test_prompt_file_and_range(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"q{i}", "second"]}) for i in range(80, 90)))
    assert load_prompts(str(f), parse_range("81-83")) == [(81, "q81"), (82, "q82"), (83, "q83")]
    with pytest.raises(ValueError, match="prompt-range"):
        parse_range("81")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(f), (200, 300))


def test_cli_train_draft_user_errors(tmp_path, capsys):
    assert main(["train-draft", "--model", "x", "--prompts", str(tmp_path / "missing.jsonl"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["train-draft", "--model", "x", "--prompts", "p", "--out", "o", "--epochs", "0"]) == 2
    assert "--epochs must be >= 1" in capsys.readouterr().err
    assert main(["train-draft", "--model", "x", "--prompts", "p", "--out", "o", "--step-decay", "0"]) == 2
    assert "--step-decay must be in (0, 1]" in capsys.readouterr().err
    assert main(["train-draft", "--model", "x", "--prompts", "p", "--out", "o", "--draft-vocab", "-3"]) == 2
    assert "--draft-vocab must be >= 0" in capsys.readouterr().err
    assert main(["train-draft", "--model", "x", "--prompts", "p", "--out", "o", "--eval-max-tokens", "128,x"]) == 2
    assert "--eval-max-tokens must be integers" in capsys.readouterr().err
    assert main(["train-draft", "--model", "x", "--prompts", "p", "--out", "o", "--eval-max-tokens", "128,0"]) == 2
    assert "--eval-max-tokens must be >= 1" in capsys.readouterr().err
    assert main(["train-draft", "--model", "x", "--prompts", "p", "--out", "o", "--copy-spans", "-1"]) == 2
    assert "--copy-spans must be >= 0" in capsys.readouterr().err


def test_sample_without_answer_targets_is_skipped():
    cfg = Eagle3Config(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8,
                       vocab_size=50, target_hidden_size=16, layer_ids=[0, 0, 0])
    head = Eagle3Head(cfg)
    loss, stats = sample_loss(head, Sample(torch.randn(3, 48), torch.tensor([1, 2, 3, 4]), prompt_len=4), 2)
    assert loss is None and stats == [(0, 0), (0, 0)]


def _fit_greedy(llm, head, prompts, ref) -> None:
    """Train ``head`` a little (6 epochs) on the target's greedy answers ``ref`` to ``prompts``."""
    opt = make_optimizer(head, 3e-3)
    with HiddenCapture(llm.engine.runner.model, head.config.layer_ids) as cap:
        samples = [capture_features(llm, cap, p + r, len(p)) for p, r in zip(prompts, ref) if len(r) > 10]
    for _ in range(6):
        for s in samples:
            train_on(head, opt, s, 3)


def _check_drafts_equal_training_forward(llm0, head, drafted) -> int:
    """Every (token ids, drafts) of ``drafted`` against the training forward (``forward_steps``)
    over the features of one prefill of the same tokens, the earlier drafts fed as the step
    inputs (and, with the copy input, the copy candidates of those tokens): draft j is the
    argmax of row n - 1, step j. Returns the drafts checked."""
    from blitzllm.spec.eagle3 import copy_candidates
    checked = 0
    with HiddenCapture(llm0.engine.runner.model, head.config.layer_ids) as cap, torch.no_grad():
        for ids, d in drafted:
            n = len(ids) - 1
            s = capture_features(llm0, cap, ids, prompt_len=1)   # features of positions 0..n-1
            seq = ids + d[:-1]   # step j at row n - 1 reads draft j - 1
            copy = None
            if head.config.copy_input:
                cand, length = copy_candidates(seq)
                copy = (torch.tensor(cand[1:] + [0]), torch.tensor(length[1:] + [0]))
            outs = head.forward_steps(s.feats, torch.tensor(seq[1:] + [0]), len(d), copy)
            for j, o in enumerate(outs):
                logits = head.logits(o[n - 1])
                # the engine's features come from decode / verify forwards: equal up to rounding
                assert float(logits.max() - logits[d[j]]) < 1e-3, (n, j, d, int(logits.argmax()))
                checked += 1
    return checked


@pytest.fixture(scope="module")
def greedy_setup(tiny4, tmp_path_factory):
    """Prompts, their plain greedy answers, and a head trained a little on the target's own
    greedy continuations (so drafts get accepted, partly), saved as a folder."""
    from blitzllm import SamplingParams
    llm0, _ = tiny4
    model_dir = llm0.engine.args.model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 320, (int(n),), generator=g).tolist() for n in (3, 9, 20, 5, 14, 30)]
    caps = [1, 40, 3, 30, 40, 17]
    params = [SamplingParams(temperature=0, max_tokens=c, ignore_eos=True) for c in caps]
    ref = [o.outputs[0].token_ids for o in llm0.generate(prompts, params)]
    llm = LLM(model_dir, device="cpu", kv_cache_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    head = _head(llm)
    _fit_greedy(llm, head, prompts, ref)
    path = str(tmp_path_factory.mktemp("greedy-head") / "head")
    head.save(path)
    return model_dir, prompts, params, ref, path


def test_eagle3_proposer_greedy_equals_plain(greedy_setup):
    model_dir, prompts, params, ref, path = greedy_setup
    # through speculative_config, as users run it
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": path}
    llm = LLM(model_dir, device="cpu", kv_cache_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
              speculative_config=spec)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out == ref
    s = llm.stats()
    assert s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] > 0.05 * s["spec_draft_tokens"]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_engine_drafts_equal_training_forward(tiny4, greedy_setup):
    """No train / inference mismatch: every draft the engine's proposer makes (from the
    features of its own prefill, decode and verify forwards, its cached step-0 K/V, and its
    own earlier draft tokens) is the argmax of the training forward (``forward_steps``,
    the training-time-test unroll) over the features of one prefill of the same tokens,
    with the earlier drafts fed as the step inputs: row n - 1, step j."""
    llm0, _ = tiny4
    model_dir, prompts, params, ref, path = greedy_setup
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": path}
    llm = LLM(model_dir, device="cpu", kv_cache_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
              speculative_config=spec)
    calls = _record_proposals(llm)
    llm.generate(prompts, params)
    st = llm.stats()
    acc = st["spec_acceptance_per_position"]
    assert 0 < acc[1] and acc[0] < 1   # drafts accepted past the first, and rejections
    drafted = [(ids, d) for ids, d in calls if d]
    assert len(drafted) > 20 and any(len(d) == 3 for _, d in drafted)
    checked = _check_drafts_equal_training_forward(llm0, llm.engine.spec.proposer.head, drafted)
    assert checked == sum(len(d) for _, d in drafted)


def test_train_draft_samples_and_eval_through_config(tiny4, tmp_path, monkeypatch):
    """train_draft with several answers per prompt (greedy + sampled) over two epochs writes a
    folder that evaluate_head runs through speculative_config; the counters add up."""
    from blitzllm.spec import train_draft as td
    llm0, _ = tiny4
    model_dir = llm0.engine.args.model
    import blitzllm.cli.train_draft as cli_td
    # tiny checkpoints have no tokenizer: text -> ids by character codes (in the training and the
    # evaluation module)
    for mod in (td, cli_td):
        monkeypatch.setattr(mod, "prompt_ids", lambda llm, text: [1 + ord(c) % 300 for c in text])
    prompts = [(i, f"question number {i} about things") for i in range(4)]
    llm = LLM(model_dir, device="cpu", kv_cache_blocks=128, enable_prefix_caching=False, max_num_seqs=8)
    logs = []
    head = td.train_draft(llm, prompts, str(tmp_path / "h"), epochs=2, max_tokens=12, steps=2, batch=2,
                          samples=3, temperature=1.0, log=logs.append)
    assert sum("epoch 1 sample" in m for m in logs) == len(prompts) * 3
    assert any(m.startswith("[train-draft] epoch 2:") for m in logs)
    assert "12 answers" in logs[-2] and "CPU" in logs[-2]
    # the sampled answers differ from the greedy one (temperature 1 over a random model)
    answers = td.generate_answers(llm, [[5, 6, 7]], 12, samples=3, temperature=1.0)
    assert [i for i, _ in answers] == [0, 0, 0] and answers[0][1] != answers[1][1]
    res = evaluate_head(model_dir, str(tmp_path / "h"), prompts[:2], k=2, max_tokens=10, device="cpu",
                           log=logs.append)
    assert res["spec_draft_tokens"] > 0 and len(res["spec_acceptance_per_position"]) == 2
    assert 1.0 <= res["spec_mean_acceptance_length"] <= 3.0 and res["eval_max_tokens"] == 10
    assert head.config.layer_ids == json.loads((tmp_path / "h" / "config.json").read_text())["layer_ids"]
    # a reduced draft vocabulary, chosen from the first batch, through the same flow
    logs = []
    head = td.train_draft(llm, prompts, str(tmp_path / "hv"), epochs=1, max_tokens=12, steps=2, batch=2,
                          samples=2, temperature=1.0, draft_vocab=40, log=logs.append)
    assert any("draft vocabulary: the 40 most frequent" in m for m in logs)
    assert json.loads((tmp_path / "hv" / "config.json").read_text())["draft_vocab_size"] == 40
    res = evaluate_head(model_dir, str(tmp_path / "hv"), prompts[:2], k=2, max_tokens=10, device="cpu",
                           log=logs.append)
    assert res["spec_draft_tokens"] > 0
    with pytest.raises(ValueError, match="--draft-vocab must be in"):
        td.train_draft(llm, prompts, None, draft_vocab=10 ** 6, log=logs.append)


def _train_with_extra_sequences(tiny4, monkeypatch, **extra):
    """train_draft on two prompts of the tiny model (12-token answers, one epoch) with the
    extra sequences ``extra`` asks for, its optimizer step replaced by a recorder: (the
    LLM, the samples it would have trained on, in order, the log lines)."""
    from blitzllm.spec import train_draft as td
    llm0, _ = tiny4
    monkeypatch.setattr(td, "prompt_ids", lambda llm, text: [1 + ord(c) % 300 for c in text])
    llm = LLM(llm0.engine.args.model, device="cpu", kv_cache_blocks=128, enable_prefix_caching=False, max_num_seqs=8)
    kept, logs = [], []
    monkeypatch.setattr(td, "train_on", lambda head, opt, s, *a: kept.append(s) or (0.0, []))
    td.train_draft(llm, [(0, "a question"), (1, "another one")], None, epochs=1, max_tokens=12, steps=2,
                   log=logs.append, **extra)
    return llm, kept, logs


def test_copy_span_sequences_and_training_on_them(tiny4, tmp_path, monkeypatch):
    """copy_span_sequence: prompt + answer + one contiguous span of the answer (>= 8 tokens),
    None for shorter answers; train_draft(copy_spans=2) trains on two such sequences per
    answer, each sample's loss counted from the copied span on (prompt_len past the answer)."""
    import random
    from blitzllm.spec import train_draft as td
    rng = random.Random(0)
    prompt, answer = [1, 2, 3], list(range(10, 40))
    for _ in range(50):
        seq = td.copy_span_sequence(prompt, answer, rng)
        span = seq[len(prompt) + len(answer):]
        assert seq[:len(prompt) + len(answer)] == prompt + answer and 8 <= len(span) <= len(answer)
        i = answer.index(span[0])
        assert answer[i:i + len(span)] == span
    assert td.copy_span_sequence(prompt, answer[:7], rng) is None
    llm, kept, logs = _train_with_extra_sequences(tiny4, monkeypatch, copy_spans=2)
    assert len(kept) == 6 and "2 answers + 4 copy sequences" in logs[-1]
    for j in range(0, 6, 3):
        first, copies = kept[j], kept[j + 1:j + 3]
        answer = first.tokens[first.prompt_len:].tolist()
        for c in copies:
            assert c.prompt_len == len(first.tokens) and torch.equal(c.tokens[:c.prompt_len], first.tokens)
            span = c.tokens[c.prompt_len:].tolist()
            assert any(answer[i:i + len(span)] == span for i in range(len(answer)))
    with pytest.raises(ValueError, match="--copy-spans must be >= 0"):
        td.train_draft(llm, [(0, "q")], None, copy_spans=-1, log=logs.append)


def test_loop_span_sequences_and_training_on_them(tiny4, monkeypatch):
    """loop_span_sequence: prompt + a prefix of the answer + a shuffled span of the answer
    (8..48 tokens) repeated LOOP_REPEATS times, the loss from the second repeat on; None for
    shorter answers. train_draft(loop_spans=2) trains on two such sequences per answer."""
    import random
    from collections import Counter
    from blitzllm.spec import train_draft as td
    rng = random.Random(1)
    prompt, answer = [1, 2, 3], list(range(10, 90))
    shuffled = 0
    for _ in range(50):
        seq, start = td.loop_span_sequence(prompt, answer, rng)
        n = (len(seq) - start) // (td.LOOP_REPEATS - 1)
        head = seq[:start - n]
        span = seq[start - n:start]
        assert 8 <= n <= 48 and len(seq) == len(head) + td.LOOP_REPEATS * n
        assert head == prompt + answer[:len(head) - len(prompt)]
        assert seq[start - n:] == span * td.LOOP_REPEATS
        i = min(span) - 10  # the span is a contiguous run of the answer, reordered
        assert sorted(span) == answer[i:i + n]
        shuffled += span != sorted(span)
    assert shuffled >= 45 and td.loop_span_sequence(prompt, answer[:7], rng) is None
    llm, kept, logs = _train_with_extra_sequences(tiny4, monkeypatch, loop_spans=2)
    assert len(kept) == 6 and "2 answers + 4 loop sequences" in logs[-1]
    for j in range(0, 6, 3):
        first, loops = kept[j], kept[j + 1:j + 3]
        answer = first.tokens[first.prompt_len:].tolist()
        for lp in loops:
            toks = lp.tokens.tolist()
            n = (len(toks) - lp.prompt_len) // (td.LOOP_REPEATS - 1)
            span = toks[lp.prompt_len - n:lp.prompt_len]
            assert toks[lp.prompt_len - n:] == span * td.LOOP_REPEATS
            assert Counter(span) <= Counter(answer)
    with pytest.raises(ValueError, match="--loop-spans must be >= 0"):
        td.train_draft(llm, [(0, "q")], None, loop_spans=-1, log=logs.append)


def test_branched_answers_turn_once_off_the_greedy_path(tiny4):
    """generate_answers(branch=True): per prompt the greedy answer, then answers that follow
    it up to a point, take one token sampled there, and continue greedily: each continuation
    equals the engine's own greedy answer from that context, and some branches leave the
    greedy path."""
    from blitzllm import SamplingParams
    from blitzllm.spec import train_draft as td
    llm0, _ = tiny4
    llm = LLM(llm0.engine.args.model, device="cpu", kv_cache_blocks=128, enable_prefix_caching=False,
              max_num_seqs=8)
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    answers = td.generate_answers(llm, prompts, 12, samples=4, temperature=1.5, seed=3, branch=True)
    assert [i for i, _ in answers] == [0, 0, 0, 0, 1, 1, 1, 1]
    greedy = {i: a for n, (i, a) in enumerate(answers) if n % 4 == 0}
    left = 0
    for n, (i, a) in enumerate(answers):
        g = greedy[i]
        assert 0 < len(a) <= 12
        if n % 4 == 0 or a == g:
            continue
        c = next(j for j in range(min(len(a), len(g))) if a[j] != g[j])  # the sampled turn
        left += 1
        if c + 1 < 12:  # the rest: greedy from prompt + answer up to the turn
            want = llm.generate([prompts[i] + a[:c + 1]], SamplingParams(temperature=0.0, max_tokens=12 - c - 1))
            assert a[c + 1:] == list(want[0].outputs[0].token_ids)
    assert left >= 3  # temperature 1.5 over a random model: most turns leave the greedy path
    assert answers == td.generate_answers(llm, prompts, 12, samples=4, temperature=1.5, seed=3, branch=True)


def test_lr_schedule():
    from blitzllm.spec.train_draft import lr_at
    assert lr_at(0, 100, 4) == 0.25 and lr_at(3, 100, 4) == 1.0
    assert lr_at(4, 100, 4) == 1.0 and abs(lr_at(100, 100, 4) - 0.1) < 1e-9
    assert lr_at(50, 100, 4) < lr_at(20, 100, 4)


def test_feature_norm_scale_invariant_and_saved(tiny4, tmp_path):
    """feature_norm: each of the three target features is RMS-normalized before fc, so the
    head's input does not depend on their scales (the raw layer outputs differ ~10x between
    layers on real models); its norm weights are saved and loaded; a head folder from before
    the option (no feature_norm key) loads as a head without it."""
    llm, _ = tiny4
    eng = llm.engine
    torch.manual_seed(0)
    head = Eagle3Head.from_target(eng.runner.model, eng.model_config, [0, 1, 2], feature_norm=True)
    H = head.config.target_hidden_size
    with torch.no_grad():
        for n in head.feature_norms:
            n.weight.uniform_(0.5, 1.5)
    feats = torch.randn(7, 3 * H)
    scaled = torch.cat([feats[:, :H] * 0.1, feats[:, H:2 * H] * 30.0, feats[:, 2 * H:] * 3.0], -1)
    with torch.no_grad():
        torch.testing.assert_close(head.project(scaled), head.project(feats), atol=1e-4, rtol=1e-4)
        plain = Eagle3Head.from_target(eng.runner.model, eng.model_config, [0, 1, 2])
        assert not torch.allclose(plain.project(scaled), plain.project(feats), atol=1e-2)
    head.save(str(tmp_path / "h"))
    back = Eagle3Head.load(str(tmp_path / "h"), target=eng.runner.model, target_cfg=eng.model_config)
    assert back.config.feature_norm
    tokens = torch.randint(0, head.config.vocab_size, (9,))
    with torch.no_grad():
        for x, y in zip(head.forward_steps(feats, tokens, 2), back.forward_steps(feats, tokens, 2)):
            torch.testing.assert_close(x, y)
    plain.save(str(tmp_path / "old"))
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    del cfg["feature_norm"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    old = Eagle3Head.load(str(tmp_path / "old"), target=eng.runner.model, target_cfg=eng.model_config)
    assert not old.config.feature_norm and not hasattr(old, "feature_norms")


def test_init_layer_copies_target_last_layer(tiny4):
    """init_layer: the head's decoder layer starts as the target's last layer (transformers'
    weights of the same checkpoint) on the hidden half of its q/k/v input; the token half
    keeps a small random start."""
    llm, hf = tiny4
    eng = llm.engine
    torch.manual_seed(0)
    head = Eagle3Head.from_target(eng.runner.model, eng.model_config, [0, 1, 2], init_layer=True)
    H = head.config.hidden_size
    ref = hf.model.layers[-1]
    for ours, theirs in ((head.q_proj, ref.self_attn.q_proj), (head.k_proj, ref.self_attn.k_proj),
                         (head.v_proj, ref.self_attn.v_proj)):
        torch.testing.assert_close(ours.weight[:, H:], theirs.weight.float())
        # nn.Linear's default start (uniform within 1 / sqrt(fan_in)) scaled by 0.1
        assert 0 < float(ours.weight[:, :H].detach().abs().max()) <= 0.1 / (2 * H) ** 0.5 + 1e-7
    for ours, theirs in ((head.o_proj, ref.self_attn.o_proj), (head.gate_proj, ref.mlp.gate_proj),
                         (head.up_proj, ref.mlp.up_proj), (head.down_proj, ref.mlp.down_proj),
                         (head.hidden_norm, ref.input_layernorm),
                         (head.post_attention_norm, ref.post_attention_layernorm)):
        torch.testing.assert_close(ours.weight, theirs.weight.float())


def test_draft_intermediate_width_saved_and_checked(tiny4, tmp_path):
    """intermediate_size: the head's MLP takes that width, the folder records it and loads
    it back to the same outputs; a width that --init-layer's copy cannot fill is refused."""
    llm, _ = tiny4
    eng = llm.engine
    cfg = eng.model_config
    torch.manual_seed(0)
    wide = 4 * cfg.intermediate_size
    head = Eagle3Head.from_target(eng.runner.model, cfg, [0, 1, 2], intermediate_size=wide)
    assert head.config.intermediate_size == wide
    assert head.gate_proj.weight.shape[0] == head.up_proj.weight.shape[0] == head.down_proj.weight.shape[1] == wide
    head.save(str(tmp_path / "w"))
    assert json.loads((tmp_path / "w" / "config.json").read_text())["intermediate_size"] == wide
    back = Eagle3Head.load(str(tmp_path / "w"), target=eng.runner.model, target_cfg=cfg)
    feats = torch.randn(6, 3 * head.config.target_hidden_size)
    tokens = torch.randint(0, head.config.vocab_size, (8,))
    with torch.no_grad():
        for x, y in zip(head.forward_steps(feats, tokens, 2), back.forward_steps(feats, tokens, 2)):
            torch.testing.assert_close(x, y)
    default = Eagle3Head.from_target(eng.runner.model, cfg, [0, 1, 2])
    assert default.config.intermediate_size == cfg.intermediate_size
    with pytest.raises(ValueError, match="--init-layer"):
        Eagle3Head.from_target(eng.runner.model, cfg, [0, 1, 2], init_layer=True, intermediate_size=wide)
    from blitzllm.spec import train_draft as td
    with pytest.raises(ValueError, match="--draft-intermediate must be positive"):
        td.train_draft(llm, [(0, "hi")], None, draft_intermediate=-1, log=lambda m: None)


def test_choose_draft_vocab():
    from blitzllm.spec.train_draft import choose_draft_vocab
    lists = [[5, 5, 7, 9], [7, 5, 2], [9, 9]]   # counts: 5:3, 9:3, 7:2, 2:1
    assert choose_draft_vocab(lists, 3, 12).tolist() == [5, 7, 9]
    assert choose_draft_vocab(lists, 2, 12).tolist() == [5, 9]   # the tie 5 / 9 both in, 7 out
    assert choose_draft_vocab(lists, 6, 12).tolist() == [0, 1, 2, 5, 7, 9]   # unseen: lowest ids
    with pytest.raises(ValueError, match="draft-vocab"):
        choose_draft_vocab(lists, 13, 12)


def test_reduced_vocab_head_rows_drafts_and_round_trip(tiny4, tmp_path):
    """reduce_vocab: the lm_head keeps the target's rows of the draft tokens, drafts come back
    as target ids, and a saved head reloads (lm_head rows from the target again) to the same
    logits; malformed maps are refused."""
    llm, _ = tiny4
    eng = llm.engine
    head = _head(llm)
    full = head.lm_head.weight.detach().clone()
    d2t = torch.tensor([3, 17, 40, 41, 200, 300])
    for bad in ([3, 3], [-1, 2], [0, head.config.vocab_size]):
        with pytest.raises(ValueError, match="distinct target token ids"):
            head.reduce_vocab(torch.tensor(bad))
    head.reduce_vocab(d2t)
    with pytest.raises(ValueError, match="already reduced"):
        head.reduce_vocab(d2t)
    assert head.config.draft_vocab_size == 6 and torch.equal(head.lm_head.weight, full[d2t])
    feats = torch.randn(5, 3 * head.config.target_hidden_size)
    tokens = torch.randint(0, head.config.vocab_size, (7,))
    with torch.no_grad():
        out = head.forward_steps(feats, tokens, 2)
        lg = head.logits(out[0])
        assert lg.shape == (5, 6)
        want = (head.norm(out[0]) @ full.t())[:, d2t].argmax(-1)   # the full logits on the draft tokens
        assert torch.equal(head.draft_tokens(lg), d2t[want])
    head.save(str(tmp_path / "h"))
    assert json.loads((tmp_path / "h" / "config.json").read_text())["draft_vocab_size"] == 6
    back = Eagle3Head.load(str(tmp_path / "h"), target=eng.runner.model, target_cfg=eng.model_config)
    assert torch.equal(back.d2t, d2t) and torch.equal(back.lm_head.weight, full[d2t])
    with torch.no_grad():
        torch.testing.assert_close(back.logits(back.forward_steps(feats, tokens, 2)[1]), head.logits(out[1]))


def test_reduced_vocab_soft_loss_and_agreement(tiny4):
    """With a reduced vocabulary the soft labels are the target's distribution over the draft
    tokens (renormalized) and a prediction counts as right when its target id is the
    target's full-vocabulary argmax."""
    llm, _ = tiny4
    ids = torch.randint(1, 320, (26,), generator=torch.Generator().manual_seed(8)).tolist()
    head = _head(llm)
    full = head.lm_head.weight.detach().clone()
    with HiddenCapture(llm.engine.runner.model, head.config.layer_ids, keep_final=True) as cap:
        s = capture_features(llm, cap, ids, prompt_len=6)
    with torch.no_grad():   # the draft vocabulary: the target's argmax tokens plus a few others
        top = (s.final.float() @ full.t()).argmax(-1)
    d2t = torch.unique(torch.cat([top[::2], torch.tensor([1, 2, 3])]))
    head.reduce_vocab(d2t)
    with torch.no_grad():
        loss, stats = sample_loss(head, s, 2)
        outs = head.forward_steps(s.feats[:24], torch.tensor(ids[1:] + [0, 0]), 2)
    def labels(fin):   # the target's distribution restricted to the draft tokens, renormalized
        logits = fin @ full.t()
        return logits, torch.softmax(logits[:, d2t], -1)
    terms, agree = _soft_terms(head, s, outs, 26, labels, d2t)
    assert float(loss) == pytest.approx(terms[0] + 0.8 * terms[1], rel=1e-5)
    assert stats == agree


def test_reduced_vocab_head_greedy_equals_plain(tiny4, greedy_setup, tmp_path):
    """A head with a reduced draft vocabulary (the tokens of the prompts and their answers),
    trained on the target's greedy answers, speculates through speculative_config: output
    equal to plain greedy, drafts accepted, every draft a draft-vocabulary token."""
    from blitzllm.spec.train_draft import choose_draft_vocab
    model_dir, prompts, params, ref, _ = greedy_setup
    llm = LLM(model_dir, device="cpu", kv_cache_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    head = _head(llm)
    d2t = choose_draft_vocab(prompts + ref, 64, head.config.vocab_size)
    head.reduce_vocab(d2t)
    _fit_greedy(llm, head, prompts, ref)
    head.save(str(tmp_path / "h"))
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(tmp_path / "h")}
    llm2 = LLM(model_dir, device="cpu", kv_cache_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
               speculative_config=spec)
    calls = _record_proposals(llm2)
    assert [o.outputs[0].token_ids for o in llm2.generate(prompts, params)] == ref
    st = llm2.stats()
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] > 0.05 * st["spec_draft_tokens"]
    drafted = [t for _, d in calls for t in d]
    assert drafted and set(drafted) <= set(d2t.tolist())


def test_copy_candidates():
    from blitzllm.spec.eagle3 import CopyIndex, copy_candidate_at, copy_candidates
    toks = [5, 6, 7, 5, 6, 9, 5, 6]
    cand, n = copy_candidates(toks)
    # p=3: "5" seen at 0 -> 6; p=4: "5 6" seen ending at 1 -> 7; p=7: "5 6" last ended at 4 -> 9
    assert (cand[3], n[3]) == (6, 1) and (cand[4], n[4]) == (7, 2) and (cand[7], n[7]) == (9, 2)
    assert n[:3] == [0, 0, 0] and cand[:3] == [0, 0, 0]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):   # the forward pass and the per-position scan back agree
        seq = torch.randint(0, 4, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        cand, n = copy_candidates(seq)
        assert [copy_candidate_at(seq[:p + 1]) for p in range(len(seq))] == list(zip(cand, n))
    # the proposer's incremental index: grown in steps, with drafts on top, and rebuilt when
    # the sequence it holds is not a prefix of the new one
    idx = CopyIndex()
    for _ in range(30):
        seq = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        for cut in sorted({1, len(seq) // 2, len(seq)}):
            idx.update(seq[:cut])
            for k in range(4):
                extra = torch.randint(0, 4, (k,), generator=g).tolist()
                assert idx.candidate(extra) == copy_candidate_at(seq[:cut] + extra), (seq[:cut], extra)


def test_copy_input_head_trains_drafts_as_trained_and_keeps_greedy(tiny4, greedy_setup, tmp_path):
    """A head with the copy input (``--copy-input``): its gates learn (they start at 0), it
    saves and loads through speculative_config, greedy output stays the plain one, and every
    draft the engine makes is the argmax of the training forward with the copy candidates of
    the same tokens (drafts included)."""
    llm0, _ = tiny4
    model_dir, prompts, params, ref, _ = greedy_setup
    llm = LLM(model_dir, device="cpu", kv_cache_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(llm.engine.runner.model, llm.engine.model_config, [0, 1, 2], copy_input=True)
    _fit_greedy(llm, head, prompts, ref)
    assert head.copy_gate[1:].abs().max() > 0 and not head.copy_gate[0].any()
    head.save(str(tmp_path / "h"))
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(tmp_path / "h")}
    llm2 = LLM(model_dir, device="cpu", kv_cache_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
               speculative_config=spec)
    loaded = llm2.engine.spec.proposer.head
    assert loaded.config.copy_input and torch.equal(loaded.copy_gate, head.copy_gate.detach())
    calls = _record_proposals(llm2)
    assert [o.outputs[0].token_ids for o in llm2.generate(prompts, params)] == ref
    st = llm2.stats()
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] > 0.05 * st["spec_draft_tokens"]
    drafted = [(ids, d) for ids, d in calls if d]
    checked = _check_drafts_equal_training_forward(llm0, loaded, drafted[:40])
    assert checked > 20
