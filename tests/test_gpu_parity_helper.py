"""tests/gpu_parity.py's ``assert_runs_agree`` (the GPU parity tests' comparison) on a scripted
engine: greedy over a table of next-token logprobs per context, no model."""
from dataclasses import dataclass

import pytest

from blitzllm import SamplingParams
from tests.gpu_parity import assert_runs_agree

PROMPTS = [[10, 11], [20]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)  # (as the GPU tests')


@dataclass
class Out:
    token_ids: list
    logprobs: list


class Scripted:
    """``generate`` runs greedy on ``table`` ({context tuple: {token: logprob}}); a context not
    in it continues with last + 1 (logprob -0.1, last + 2 next at -3)."""

    def __init__(self, table=None):
        self.table, self.calls = table or {}, []

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params.max_tokens))
        outs = []
        for p in prompts:
            ctx, ids, lps = list(p), [], []
            for _ in range(params.max_tokens):
                lp = self.table.get(tuple(ctx), {ctx[-1] + 1: -0.1, ctx[-1] + 2: -3.0})
                t = max(lp, key=lp.get)
                ids.append(t)
                lps.append(lp)
                ctx.append(t)
            outs.append(Out(ids, lps))
        return outs


def _check(got_table, want_table=None):
    """(assert_runs_agree's forks, the engine under test's generate calls after its first)."""
    llm = Scripted(got_table)
    got = llm.generate(PROMPTS, PARAMS)
    want = Scripted(want_table).generate(PROMPTS, PARAMS)
    llm.calls.clear()
    return assert_runs_agree(llm, PROMPTS, got, want, PARAMS), llm.calls


def test_identical_runs_pass_without_restarts():
    assert _check({}) == ([], [])


def test_a_near_tie_at_step_0_forks_once_then_agrees():
    forks, calls = _check({(10, 11): {30: -1.00, 12: -1.01}}, {(10, 11): {12: -1.00, 30: -1.01}})
    assert forks == [(0, 0)]
    assert calls == [([[10, 11, 12]], 7)]   # teacher-forced on the reference's token, 7 steps left


def test_the_restarted_run_is_still_compared():
    table = {(10, 11): {30: -1.00, 12: -1.01}, (10, 11, 12, 13, 14): {15: -0.2, 16: -3.0}}
    with pytest.raises(AssertionError, match=r"logprobs differ: sequence 0 step 3 \(forks at \[0\]\)"):
        _check(table, {(10, 11): {12: -1.00, 30: -1.01}})


def test_a_divergence_that_is_no_near_tie_fails():
    # a near tie in the run under test, but not in the reference: the message has both logprobs
    with pytest.raises(AssertionError, match=r"not a near tie: .*\{30: -1.0, 12: -1.03\} vs \{12: -1.0, 30: -1.3\}"):
        _check({(10, 11): {30: -1.0, 12: -1.03}}, {(10, 11): {12: -1.0, 30: -1.3}})
    with pytest.raises(AssertionError, match="not a near tie"):  # the other token absent from the reference's
        _check({(20,): {40: -1.0, 21: -1.01}}, {(20,): {21: -1.0, 22: -1.01}})


def test_a_fork_where_each_logprob_moved_within_tol_passes():
    # each token 0.04 from the reference's (tol 0.05), in opposite directions: 0.06 apart in the
    # run under test, 0.02 in the reference's (seen on an H100: deepseek-v3.2, 6/32 against 1/32)
    forks, _ = _check({(10, 11): {30: -1.00, 12: -1.06}}, {(10, 11): {12: -1.02, 30: -1.04}})
    assert forks == [(0, 0)]
    with pytest.raises(AssertionError, match="not a near tie"):   # 0.06 apart in the reference: no near tie
        _check({(10, 11): {30: -1.00, 12: -1.01}}, {(10, 11): {12: -0.98, 30: -1.04}})


def test_a_logprob_off_by_0_1_fails():
    with pytest.raises(AssertionError, match=r"logprobs differ: sequence 1 step 2 .*\{23: -0.2, 24: -3.0\} vs "
                                             r"\{23: -0.1, 24: -3.0\}"):
        _check({(20, 21, 22): {23: -0.2, 24: -3.0}})


def test_at_most_a_quarter_of_the_steps_fork():
    tie = {(10, 11): 12, (10, 11, 12, 13): 14, (10, 11, 12, 13, 14, 15): 16}   # context: the reference's token
    want = {c: {t: -1.00, 40: -1.01} for c, t in tie.items()}
    got = {c: {40: -1.00, t: -1.01} for c, t in tie.items()}
    two = dict(got)
    two[(10, 11, 12, 13, 14, 15)] = want[(10, 11, 12, 13, 14, 15)]   # (the third step as the reference's)
    assert _check(two, want)[0] == [(0, 0), (0, 2)]   # 8 tokens: 2 forks allowed
    with pytest.raises(AssertionError, match=r"more than 2 near-tie forks: sequence 0 step 4 \(forks at \[0, 2\]\)"):
        _check(got, want)


def test_forks_at_exact_ties_of_the_run_under_test_are_not_counted():
    # the run under test gives both tokens the same logprob at every fork (its argmax took the
    # lower id): four forks in 8 tokens pass; with one of them 0.01 apart, the limit holds again
    tie = {(10, 11): 12, (10, 11, 12, 13): 14, (10, 11, 12, 13, 14, 15): 16, (10, 11, 12, 13, 14, 15, 16, 17): 18}
    want = {c: {t: -1.00, 3: -1.01} for c, t in tie.items()}
    got = {c: {3: -1.00, t: -1.00} for c, t in tie.items()}
    assert _check(got, want)[0] == [(0, 0), (0, 2), (0, 4), (0, 6)]
    got.update({c: {3: -1.00, t: -1.01} for c, t in list(tie.items())[:3]})
    with pytest.raises(AssertionError, match=r"more than 2 near-tie forks: sequence 0 step 4"):
        _check(got, want)
