"""The generation loop on fake contexts: greedy oracle for every mode, KV bookkeeping, settings
changed mid-generation, cancel, context limits. (Real llama.cpp: test_oracle.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from speculative.costmodel import VerifyCost
from speculative.drafting import TreeBudget
from speculative.engine import Engine, Mode, SpecConfig
from speculative.errors import IncompatibleModels, PromptTooLong
from speculative.ngram import KatzTrigram
from speculative.oracle import OracleDrafter
from speculative.sampling import SamplingParams
from speculative.stats import RunStats
from tests.fakes import FakeContext, logit_table, noisy

V = 12
TARGET = logit_table(V, seed=1)
DRAFT = noisy(TARGET, seed=2, noise=1.0)
PROMPTS = [list(np.random.default_rng(s).integers(0, V, size=1 + s % 5)) for s in range(20)]
BUDGETS = [TreeBudget(1, 1, 1), TreeBudget(4, 3, 2), TreeBudget(8, 5, 3), TreeBudget(12, 8, 4)]


DEFAULT_BUDGET = TreeBudget()


def _engine(mode: Mode, budget: TreeBudget = DEFAULT_BUDGET, n_ctx: int = 64,
            corpus: list[list[int]] | None = None, draft: np.ndarray = DRAFT,
            adaptive: bool = True) -> Engine:
    """``adaptive`` sizes trees by the fakes' measured timings, so tree shapes vary from run
    to run (the output never does); pass False where a test compares shapes."""
    ngram = KatzTrigram.build(corpus or [list(np.random.default_rng(9).integers(0, V, 200))], V)
    return Engine(FakeContext(TARGET, n_ctx=n_ctx), FakeContext(draft, n_ctx=n_ctx), ngram,
                  SpecConfig(mode=mode, tree=budget, chain_length=3, lookahead=3,
                             adaptive=adaptive))


def _generate(engine: Engine, prompt: list[int], n: int, **kw) -> list[int]:
    out: list[int] = []
    for step in engine.generate(prompt, n, **kw):
        out += step.tokens
    return out


def _plain(prompt: list[int], n: int) -> list[int]:
    out, ctx = [], list(prompt)
    for _ in range(n):
        a, b = ([0, 0, *ctx])[-2:]
        ctx.append(int(np.argmax(TARGET[a, b].astype(np.float32))))
        out.append(ctx[-1])
    return out


@pytest.mark.parametrize("mode", Mode.selectable())
@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"{b.max_nodes}n{b.max_depth}d")
def test_greedy_equals_plain_decoding(mode: Mode, budget: TreeBudget) -> None:
    engine = _engine(mode, budget)
    for prompt in PROMPTS:
        assert _generate(engine, prompt, 24) == _plain(prompt, 24), (mode, prompt)


@pytest.mark.parametrize("mode", [Mode.TREE, Mode.STAGED, Mode.CHAIN])
def test_cache_holds_exactly_the_committed_tokens(mode: Mode) -> None:
    engine = _engine(mode, TreeBudget(8, 4, 3))
    prompt = [1, 2, 3]
    out = _generate(engine, prompt, 30)
    committed = prompt + out
    target, draft = engine.target.ctx, engine.draft.ctx
    assert target.held(0) == committed[: len(target.held(0))]
    assert len(target.held(0)) >= len(committed) - 1 - 8  # at most the last step's tail is pending
    assert {s for c in target.cells for s in c.seqs} == {0}  # no tree sequence left behind
    assert {s for c in draft.cells for s in c.seqs} == {0}
    assert draft.held(0) == committed[: len(draft.held(0))]


def test_drafting_saves_target_passes() -> None:
    """A good draft must cut the number of target passes; if it does not, speculation is broken
    even if the output is right."""
    runs = {}
    for mode in (Mode.PLAIN, Mode.CHAIN, Mode.TREE, Mode.STAGED):
        run = RunStats()
        _generate(_engine(mode, TreeBudget(8, 4, 3), adaptive=False), [1, 2], 40, run=run)
        runs[mode] = run
    assert len(runs[Mode.PLAIN].steps) == 40
    assert runs[Mode.TREE].tau > 1.5
    assert runs[Mode.CHAIN].tau > 1.2
    assert runs[Mode.STAGED].tau == pytest.approx(runs[Mode.TREE].tau)  # same trees
    for run in runs.values():
        assert run.tokens == 40
        assert sum(run.origins().values()) == 40


def test_stage2_saves_draft_calls_on_repetitive_text() -> None:
    """With an n-gram that knows the text (and a draft that agrees with the target), staged mode
    needs fewer draft calls than tree mode for the identical output."""
    text = _plain([3, 4], 60)
    corpus = [[3, 4, *text]] * 3
    calls = {}
    outs = {}
    for mode in (Mode.TREE, Mode.STAGED):
        run = RunStats()
        engine = _engine(mode, TreeBudget(6, 6, 1), corpus=corpus, draft=TARGET, adaptive=False)
        outs[mode] = _generate(engine, [3, 4], 40, run=run)
        calls[mode] = sum(s.draft_calls for s in run.steps)
        if mode is Mode.STAGED:
            assert run.stage2_hit_rate > 0.5
            assert run.origins()["ngram"] > 0
    assert outs[Mode.TREE] == outs[Mode.STAGED]
    assert calls[Mode.STAGED] < calls[Mode.TREE] * 0.7


def test_settings_change_mid_generation_stays_exact() -> None:
    engine = _engine(Mode.PLAIN)
    out = []
    modes = [Mode.TREE, Mode.NGRAM, Mode.PLAIN, Mode.STAGED, Mode.CHAIN] * 4
    for i, step in enumerate(engine.generate([5, 6], 40)):
        out += step.tokens
        engine.config = SpecConfig(mode=modes[i % len(modes)],
                                   tree=BUDGETS[i % len(BUDGETS)])
    assert out == _plain([5, 6], 40)


def test_second_turn_reuses_the_cache() -> None:
    engine = _engine(Mode.TREE, TreeBudget(4, 3, 2))
    first = _generate(engine, [1, 2, 3], 10)
    ctx = engine.target.ctx
    before = ctx.decoded_tokens
    turn2 = [1, 2, 3, *first, 7, 8]
    second = _generate(engine, turn2, 10)
    assert second == _plain(turn2, 10)
    # the second turn's prefill decoded only the new tokens, not the whole history again
    assert ctx.decoded_tokens - before < len(turn2) + 10 * 5


def test_cancel_stops_between_steps() -> None:
    engine = _engine(Mode.TREE)
    calls = iter(range(100))
    steps = list(engine.generate([1], 50, cancel=lambda: next(calls) >= 3))
    assert steps[-1].finish == "cancelled"
    assert len(steps) == 4
    # the engine is still usable and exact afterwards
    assert _generate(engine, [1], 10) == _plain([1], 10)


def test_stop_token_and_length_limit() -> None:
    plain = _plain([2], 30)
    engine = _engine(Mode.TREE, TreeBudget(8, 5, 2))
    stop = plain[7]
    first = plain.index(stop)
    steps = list(engine.generate([2], 30, stop={stop}))
    assert [t for s in steps for t in s.tokens] == plain[:first]
    assert steps[-1].finish == "stop"
    steps = list(_engine(Mode.TREE, TreeBudget(8, 5, 2)).generate([2], 13))
    assert [t for s in steps for t in s.tokens] == plain[:13]
    assert steps[-1].finish == "length"


def test_generation_ends_at_the_context_window() -> None:
    engine = _engine(Mode.STAGED, TreeBudget(8, 6, 2), n_ctx=20)
    steps = list(engine.generate([1, 2, 3], 100))
    out = [t for s in steps for t in s.tokens]
    assert steps[-1].finish == "context"
    assert len(out) == 20 - 3 + 1  # every position of the window, then one last token
    assert out == _plain([1, 2, 3], len(out))


def test_prompt_longer_than_the_context_is_refused_and_engine_survives() -> None:
    engine = _engine(Mode.TREE, n_ctx=16)
    with pytest.raises(PromptTooLong, match="17 tokens"):
        list(engine.generate([*range(12), 1, 2, 3, 4, 5], 5))
    assert _generate(engine, [1, 2], 5) == _plain([1, 2], 5)


def test_vocabulary_mismatch_is_refused() -> None:
    other = FakeContext(logit_table(V + 1, seed=3))
    with pytest.raises(IncompatibleModels, match="13 tokens"):
        Engine(FakeContext(TARGET), other)


def test_mode_without_draft_model_is_refused() -> None:
    engine = Engine(FakeContext(TARGET))
    engine.config = SpecConfig(mode=Mode.TREE)
    with pytest.raises(ValueError, match="needs a draft"):
        list(engine.generate([1], 3))
    engine.config = SpecConfig(mode=Mode.NGRAM)
    assert _generate(engine, [1], 8) == _plain([1], 8)


def test_seeded_sampling_is_reproducible() -> None:
    params = SamplingParams(temperature=0.9, top_k=6, seed=123)
    def engine() -> Engine:  # fixed tree shapes: the seed then fixes every draw
        return _engine(Mode.STAGED, TreeBudget(6, 4, 3), adaptive=False)

    a = _generate(engine(), [1, 2], 30, params=params)
    b = _generate(engine(), [1, 2], 30, params=params)
    c = _generate(engine(), [1, 2], 30,
                  params=SamplingParams(temperature=0.9, top_k=6, seed=124))
    assert a == b
    assert a != c


def test_draft_out_of_sequence_ids_stops_growing_not_generating() -> None:
    ngram = KatzTrigram.build([[1, 2, 3, 4]], V)
    engine = Engine(FakeContext(TARGET), FakeContext(DRAFT, n_seq_max=5), ngram,
                    SpecConfig(mode=Mode.STAGED, tree=TreeBudget(12, 8, 3), lookahead=3))
    run = RunStats()
    assert _generate(engine, [1, 2], 30, run=run) == _plain([1, 2], 30)
    assert run.tau > 1.0


def test_tree_larger_than_the_target_batch_is_refused() -> None:
    engine = Engine(FakeContext(TARGET, n_batch=8), FakeContext(DRAFT),
                    config=SpecConfig(mode=Mode.TREE, tree=TreeBudget(8, 4, 2)))
    with pytest.raises(ValueError, match="n_batch and n_seq_max >= 9"):
        list(engine.generate([1], 5))


def _auto(target_cost: tuple, draft_cost: tuple, draft: np.ndarray = DRAFT) -> Engine:
    engine = _engine(Mode.AUTO, TreeBudget(24, 8, 3), draft=draft)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), target_cost)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), draft_cost)
    return engine


FLAT = (1.0, 1.02, 1.05, 1.1, 1.2, 1.4)        # a GPU: 32 tokens cost little more than one
STEEP = (1.0, 1.75, 2.24, 3.5, 5.3, 9.2)       # a 2-core CPU: a second token costs 0.75
CHEAP_DRAFT = (0.05, 0.06, 0.07, 0.09, 0.12, 0.2)


def test_ngram_trees_grow_only_nodes_that_could_pay() -> None:
    """Where a batch token costs a good share of a pass, an n-gram node whose calibrated
    score is below that share is never expanded (its children score less still): fewer
    n-gram queries, the same exact output. Where batches are free, the tree grows whole."""
    from speculative.drafting import NgramDrafter, grow_tree, sparse_top
    from speculative.planner import Planner

    assert Planner(VerifyCost((1, 2, 4, 8, 16, 32), STEEP), None).least_worth() \
        == pytest.approx((5.3 - 3.5) / 8)  # the cheapest extra token: between 8 and 16
    assert Planner(VerifyCost((1, 2, 4, 8, 16, 32), FLAT), None).least_worth() < 0.02
    grown = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        engine = _auto(curve, CHEAP_DRAFT)
        engine.measure_cost()
        params = SamplingParams()
        budget = TreeBudget(24, 8, 3)
        sizes = []
        for prompt in PROMPTS[:8]:
            ngram = NgramDrafter(engine.ngram, sparse_top(params, budget.max_children))
            tree = grow_tree(ngram, prompt, budget, params, np.random.default_rng(0),
                             engine._worth_growing()).tree
            least = engine.planner.least_worth()
            parents = {tree.parents[v] for v in range(1, len(tree))}
            assert all(tree.scores[u] >= least for u in parents)  # only worthy nodes grew
            sizes.append(len(tree))
        grown[name] = sum(sizes)
    assert grown["flat"] > grown["steep"]
    for mode in (Mode.AUTO, Mode.NGRAM):
        engine = _engine(mode)
        engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), STEEP)
        for prompt in PROMPTS[:6]:
            assert _generate(engine, prompt, 24) == _plain(prompt, 24)


def test_auto_drafts_what_the_cost_curve_pays_for_and_stays_exact() -> None:
    drafted = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        engine = _auto(curve, CHEAP_DRAFT)
        run = RunStats()
        for prompt in PROMPTS[:8]:
            assert _generate(engine, prompt, 24, run=run) == _plain(prompt, 24), name
        drafted[name] = run.mean_drafted
    assert drafted["flat"] > 2 * drafted["steep"] > 0


def test_auto_stops_drafting_when_the_draft_is_useless() -> None:
    useless = noisy(TARGET, seed=11, noise=50.0)  # its guesses are nearly never the target's
    engine = _auto(STEEP, (0.5, 0.8, 1.1, 1.8, 3.0, 5.5), draft=useless)
    run = RunStats()
    for prompt in PROMPTS[:10]:
        assert _generate(engine, prompt, 24, run=run) == _plain(prompt, 24)
    late = run.steps[len(run.steps) // 2:]
    assert sum(s.draft_calls for s in late) <= 0.2 * len(late)  # learned: mostly plain now


def test_no_probe_of_the_draft_where_the_ngram_tree_pays() -> None:
    """A probe is due (drafting measured a loss, EXPLORE_EVERY steps passed), but at a step
    where the n-gram's own tree already pays (a baseline rate) a short chain could not beat
    it: the draft does not run. Where the n-gram offers nothing, the probe runs."""
    from speculative.drafting import ModelDrafter
    from speculative.planner import EXPLORE_EVERY

    engine = _auto(STEEP, CHEAP_DRAFT)
    engine.measure_cost()
    planner = engine.planner
    for _ in range(10):
        planner.observe_step("root", 10, 0.1)
        planner.observe_step("draft", 1, 0.1)
    planner.regret = -100.0  # budget to spare: only the rule can stop the probe
    assert planner.measured_loss("draft")
    prompt, params = PROMPTS[4], SamplingParams()
    budget = TreeBudget(24, 8, 3)
    runs = []
    for baseline in (50.0, 0.0):
        planner.idle = EXPLORE_EVERY
        drafter = ModelDrafter(engine.draft, None, 0)
        tree = engine._maybe_draft(drafter, prompt, budget, params, np.random.default_rng(0),
                                   engine._expander(budget), baseline)
        engine.draft.rollback()
        runs.append((len(tree.tree) - 1, drafter.counters.calls))
    assert runs[0] == (0, 0)  # the n-gram pays: no draft call
    assert runs[1][1] > 0 and 1 <= runs[1][0] <= 3  # nothing else pays: a probe of <= 3


def test_auto_probes_with_a_short_chain_while_drafting_measures_a_loss() -> None:
    """The cost model says drafting pays (a flat curve), the measured step rates say it loses:
    auto runs the target alone, and explores with a chain of at most ``PROBE`` tokens, never
    a full tree (verified at the steep end of a real curve, one costs several passes)."""
    from speculative.engine import PROBE
    from speculative.planner import EXPLORE_EVERY, Planner

    class Measured(Planner):  # the rates stay as planted: drafting measured 10x slower
        def observe_step(self, kind: str, tokens: int, seconds: float) -> None:
            pass

    engine = _auto(FLAT, CHEAP_DRAFT)
    planner = engine.planner = Measured(engine.verify_cost, engine.draft_cost)
    for _ in range(10):
        Planner.observe_step(planner, "root", 10, 0.1)
        Planner.observe_step(planner, "draft", 1, 0.1)
    assert planner.measured_loss("draft")
    for prompt in PROMPTS[:5]:  # greedy: exact (the probes get n-gram guesses hung below)
        assert _generate(engine, prompt, 24) == _plain(prompt, 24)
    run = RunStats()
    for i, prompt in enumerate(PROMPTS[:10]):  # sampled: the tree is the draft's alone
        _generate(engine, prompt, 24, params=SamplingParams(1.0, 0, 1.0, i), run=run)
    probes = [s for s in run.steps if s.draft_calls]
    # one at each reply's start (Planner.new_text), then one per EXPLORE_EVERY steps at most
    assert 1 <= len(probes) <= 10 + len(run.steps) // EXPLORE_EVERY
    assert all(s.drafted <= PROBE for s in probes)


def test_merged_tree_holds_both_trees_scored_by_their_calibrations() -> None:
    from speculative.drafting import DraftCounters, DraftTree, NgramDrafter
    from speculative.tree import TokenTree

    engine = _auto(FLAT, CHEAP_DRAFT)
    engine._calibrations["draft"].add(3, 4.0)     # the draft: 0.75 of what it predicts
    engine._calibrations["branches"].add(1, 4.0)  # n-gram branches beside it: 0.25
    draft = TokenTree.rooted(7)
    a = draft.add(0, 1, 0.8, "draft")
    draft.add(a, 2, 0.6, "draft")
    draft.add(0, 3, 0.1, "draft")
    ngram = TokenTree.rooted(7)
    b = ngram.add(0, 1, 0.5, "ngram")   # the draft's path too: keeps the draft's estimate
    ngram.add(b, 4, 0.4, "ngram")       # a branch beside the draft's 2
    ngram.add(0, 5, 0.3, "ngram")       # a branch beside the draft's 1 and 3

    class Counted:
        counters = DraftCounters()

    merged = engine._merge(DraftTree(draft, {}), DraftTree(ngram, {}), Counted(),
                           NgramDrafter(engine.ngram), TreeBudget(24, 8, 3)).tree
    estimates = {merged.path(v): merged.scores[v] for v in range(1, len(merged))}
    assert estimates == pytest.approx({(1,): 0.6, (1, 2): 0.45, (3,): 0.075,
                                       (1, 4): 0.1, (5,): 0.075})
    assert {merged.origins[v] for v in range(1, len(merged))
            if merged.path(v) in ((1, 4), (5,))} == {"ngram"}
    capped = engine._merge(DraftTree(draft, {}), DraftTree(ngram, {}), Counted(),
                           NgramDrafter(engine.ngram), TreeBudget(2, 8, 3)).tree
    assert len(capped) - 1 == 2  # never more nodes than the target's batch was sized for


def test_auto_greedy_verifies_ngram_branches_beside_the_draft_and_stays_exact() -> None:
    """A flat cost curve (a GPU), a noisy draft and an n-gram model that knows the target's
    text: the merged trees' n-gram branches are verified, some accepted, every reply exact.
    (The fakes' step rates are not measured: their Python overhead would make every kind of
    drafting lose to the target alone, see Planner.measured_loss.)"""
    from speculative.planner import Planner

    class Unmeasured(Planner):
        def observe_step(self, kind: str, tokens: int, seconds: float) -> None:
            pass

    corpus = [_plain(prompt, 40) for prompt in PROMPTS[10:12]]  # knows some of the text
    engine = _engine(Mode.AUTO, TreeBudget(24, 8, 3), corpus=corpus)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), FLAT)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
    engine.planner = Unmeasured(engine.verify_cost, engine.draft_cost)
    for prompt in PROMPTS[:10]:
        assert _generate(engine, prompt, 24) == _plain(prompt, 24)
    branches = engine._calibrations["branches"]
    assert branches.predicted > 0 and branches.accepted > 0


def test_auto_without_a_draft_model_uses_the_ngram_model() -> None:
    ngram = KatzTrigram.build([list(np.random.default_rng(9).integers(0, V, 200))], V)
    engine = Engine(FakeContext(TARGET), None, ngram, SpecConfig(mode=Mode.AUTO))
    for prompt in PROMPTS[:5]:
        assert _generate(engine, prompt, 16) == _plain(prompt, 16)


def test_the_oracle_knows_the_answer_and_is_never_rejected() -> None:
    engine = _engine(Mode.ORACLE, TreeBudget(8, 8, 1))
    # a fixed curve: the fakes' own timings are microseconds of Python, linear in the batch,
    # and on a busy machine noisy enough to make one-node trees look best (tau 2.0, seen).
    # A CPU's: on a flat one a guess past the known text (score 1 / V, V = 12 here) would pay
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), STEEP)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
    with pytest.raises(ValueError, match="oracle"):
        _generate(engine, PROMPTS[3], 10)
    for prompt in PROMPTS[:6]:
        answer = _plain(prompt, 30)
        engine.oracle = OracleDrafter(answer, len(prompt), V)
        run = RunStats()
        assert _generate(engine, prompt, 30, run=run) == answer
        assert all(s.accepted == s.drafted for s in run.steps)
        assert run.tau > 2


def test_a_new_engine_carries_on_from_what_another_learned() -> None:
    """The bench makes an engine per reply and hands on ``Learned``, as the app keeps its
    engine: the planner (rates, budget) and the calibrations continue, and output stays exact."""
    first = _auto(STEEP, CHEAP_DRAFT)
    for prompt in PROMPTS[:3]:
        _generate(first, prompt, 24)
    learned = first.learned()
    assert learned.planner is not None and learned.planner.elapsed > 0
    second = _auto(STEEP, CHEAP_DRAFT)
    second.adopt(learned)
    assert second.planner is learned.planner
    assert second._calibrations is learned.calibrations
    elapsed = learned.planner.elapsed
    assert _generate(second, PROMPTS[3], 24) == _plain(PROMPTS[3], 24)
    assert second.planner.elapsed > elapsed  # the same planner went on measuring
