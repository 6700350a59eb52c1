"""``LLM`` as vLLM's users call it: the ``sampling_params`` keyword, prompt dicts
(``{"prompt": text}`` / ``{"prompt_token_ids": ids}``) and ``cumulative_logprob``."""
import pytest

from blitzllm import SamplingParams
from tests.conftest import hf_logprobs

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_prompt_dicts_and_the_sampling_params_keyword(smollm2_llm):
    llm = smollm2_llm
    ids = llm.tokenize("The capital of France is")
    want = llm.generate(ids, GREEDY)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}], sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [want, want]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, sampling_params=GREEDY)[0].outputs[0].token_ids == want
    assert "".join(llm.stream({"prompt_token_ids": ids}, sampling_params=GREEDY)) == outs[0].outputs[0].text
    chat = [{"role": "user", "content": "Hi"}]
    assert (llm.chat(chat, sampling_params=GREEDY)[0].outputs[0].token_ids
            == llm.generate(llm.apply_chat_template(chat), GREEDY)[0].outputs[0].token_ids)


@pytest.mark.parametrize("bad", [{"prompt": "a", "prompt_token_ids": [1]}, {"text": "a"}, {}, {"prompt": [1, 2]},
                                 {"prompt_token_ids": "12"}])
def test_a_bad_prompt_dict_is_a_value_error(smollm2_llm, bad):
    with pytest.raises(ValueError, match="a dict of one key"):
        smollm2_llm.generate([bad], GREEDY)
    stats = smollm2_llm.stats()
    assert not smollm2_llm.engine.has_unfinished() and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_cumulative_logprob_is_the_sequences_logprob(smollm2_llm, smollm2_hf):
    llm = smollm2_llm
    ids = llm.tokenize("Once upon a time")
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))[0].outputs[0]
    want = float(hf_logprobs(smollm2_hf, ids, out.token_ids).sum())   # transformers on the same weights
    assert out.cumulative_logprob == pytest.approx(want, abs=1e-3)
    assert llm.generate(ids, GREEDY)[0].outputs[0].cumulative_logprob is None   # no logprobs asked: none


def test_chat_template_options(smollm2_llm):
    llm, tok = smollm2_llm, smollm2_llm.tokenizer
    user = [{"role": "user", "content": "What is the capital of France?"}]
    # continue_final_message: the opened assistant turn of the plain render, then the partial answer
    opened = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    ids = llm.apply_chat_template(user + [{"role": "assistant", "content": "The capital"}],
                                  add_generation_prompt=False, continue_final_message=True)
    assert ids == tok(opened + "The capital", add_special_tokens=False).input_ids
    # chat_template, chat_template_kwargs and tools reach the template
    own = ("{{ greeting }}{% for t in tools or [] %}<{{ t['function']['name'] }}>{% endfor %}"
           "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    ids = llm.apply_chat_template(user, chat_template=own, chat_template_kwargs={"greeting": "Yo "}, tools=tools)
    assert ids == tok("Yo <get_weather>What is the capital of France?", add_special_tokens=False).input_ids
    out = llm.chat(user, GREEDY, chat_template=own, chat_template_kwargs={"greeting": "Yo "})[0]
    assert out.prompt_token_ids == tok("Yo What is the capital of France?", add_special_tokens=False).input_ids


@pytest.mark.parametrize("kw, words", [
    ({"continue_final_message": True}, "add_generation_prompt=False"),
    ({"chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
    ({"chat_template": "{{ raise_exception('no system role') }}"}, "rejected the messages"),
])
def test_bad_chat_options_are_value_errors(smollm2_llm, kw, words):
    with pytest.raises(ValueError, match=words):
        smollm2_llm.chat([{"role": "user", "content": "Hi"}], GREEDY, **kw)


def test_num_cached_tokens_counts_the_prefix_cache_hit(smollm2_llm):
    llm = smollm2_llm
    ids = llm.tokenize("A long shared preamble that the prefix cache keeps between requests. " * 6)
    first = llm.generate(ids + [42], GREEDY)[0]
    again = llm.generate(ids + [43], GREEDY)[0]
    bs = llm.engine.args.block_size
    # the second request finds the first's full blocks of the shared prefix, at most the prompt less one
    assert first.num_cached_tokens < len(ids)
    assert again.num_cached_tokens == (len(ids) // bs) * bs > 0


def test_use_tqdm_shows_vllms_progress_bar(smollm2_llm, capsys, monkeypatch):
    """generate and chat take vLLM's ``use_tqdm`` (default True): a "Processed
    prompts" bar on stderr that ends at every prompt (n > 1 counts a prompt once all its
    samples finished); ``use_tqdm=False`` or BLITZ_NO_PROGRESS shows none, and the outputs are
    the same either way."""
    monkeypatch.delenv("BLITZ_NO_PROGRESS", raising=False)
    llm = smollm2_llm
    prompts = ["The capital of France is", "1 2 3", "Hello"]
    with_bar = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "4/3" not in err and "output:" in err
    without = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    assert [[c.token_ids for c in o.outputs] for o in with_bar] == [[c.token_ids for c in o.outputs] for o in without]
    llm.chat([{"role": "user", "content": "Hi"}], GREEDY)
    assert "1/1" in capsys.readouterr().err
    monkeypatch.setenv("BLITZ_NO_PROGRESS", "1")
    llm.generate(prompts, GREEDY)
    assert "Processed prompts" not in capsys.readouterr().err


def test_get_tokenizer_is_the_engines(smollm2_llm):
    """vLLM's ``llm.get_tokenizer()``: the tokenizer the engine encodes with, so a script's own
    chat-template rendering gives the ids ``LLM.chat`` runs."""
    llm = smollm2_llm
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    chat = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok(text, add_special_tokens=False).input_ids == llm.apply_chat_template(chat)


def test_blitz_chat_keeps_the_history_and_shows_no_bar(capsys, monkeypatch):
    """``blitz chat``: each turn's reply is ``LLM.chat``'s on the conversation so far (the earlier
    replies in it), /reset starts over (the same first question, the same reply), an empty line
    quits; no progress bar between the turns."""
    from blitzllm import LLM
    from blitzllm.cli import main
    monkeypatch.delenv("BLITZ_NO_PROGRESS", raising=False)
    lines = iter(["What is the capital of France?", "And of Italy?", "/reset", "What is the capital of France?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["--model", "smollm2", "--device", "cpu", "--max-model-len", "512", "--temperature", "0",
            "--max-tokens", "8"]
    assert main(["chat", *argv]) == 0
    out, err = capsys.readouterr()
    replies = out.strip("\n").split("\n")
    assert "Processed prompts" not in err
    llm = LLM("smollm2", device="cpu", max_model_len=512)
    p = SamplingParams(temperature=0, max_tokens=8)
    first = llm.chat([{"role": "user", "content": "What is the capital of France?"}], p, use_tqdm=False)[0].outputs[0]
    second = llm.chat([{"role": "user", "content": "What is the capital of France?"},
                       {"role": "assistant", "content": first.text},
                       {"role": "user", "content": "And of Italy?"}], p, use_tqdm=False)[0].outputs[0]
    assert "\n".join(replies) == "\n".join([first.text, second.text, first.text])


def test_cache_salt_keeps_prefixes_apart(smollm2_llm):
    """vLLM's ``cache_salt``: KV is shared only between requests of the same salt (none being a
    salt of its own); the salted answers are the unsalted ones; a bad salt is a ValueError that
    leaves nothing behind."""
    llm = smollm2_llm
    ids = llm.tokenize("Tenant preamble kept apart by the salt of each request in the prefix cache. " * 5)
    bs = llm.engine.args.block_size
    full = (len(ids) // bs) * bs
    plain = llm.generate(ids + [7], GREEDY)[0]
    a1 = llm.generate({"prompt_token_ids": ids + [8], "cache_salt": "tenant-a"}, GREEDY)[0]
    a2 = llm.generate({"prompt_token_ids": ids + [9], "cache_salt": "tenant-a"}, GREEDY)[0]
    b1 = llm.generate({"prompt_token_ids": ids + [7], "cache_salt": "tenant-b"}, GREEDY)[0]
    again = llm.generate(ids + [8], GREEDY)[0]
    assert a1.num_cached_tokens == 0 and b1.num_cached_tokens == 0   # (neither the unsalted nor a's blocks)
    assert a2.num_cached_tokens == full > 0 and again.num_cached_tokens == full
    assert b1.outputs[0].token_ids == plain.outputs[0].token_ids
    assert a1.outputs[0].token_ids == again.outputs[0].token_ids
    text = "".join(llm.stream({"prompt": "Hi there", "cache_salt": "s"}, GREEDY))
    assert text == llm.generate("Hi there", GREEDY)[0].outputs[0].text
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate([ids, {"prompt_token_ids": ids, "cache_salt": bad}], GREEDY)
    stats = llm.stats()
    assert not llm.engine.has_unfinished() and stats["kv_blocks_free"] == stats["kv_blocks_total"]
