"""The generation loop on fake contexts: greedy oracle for every mode, KV bookkeeping, settings
changed mid-generation, cancel, context limits. (Real llama.cpp: test_oracle.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from speculative.costmodel import VerifyCost
from speculative.drafting import TreeBudget
from speculative.engine import Engine
from speculative.errors import IncompatibleModels, PromptTooLong
from speculative.ngram import KatzTrigram
from speculative.oracle import OracleDrafter
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams
from speculative.stats import RunStats
from tests.fakes import FakeContext, logit_table, noisy

V = 12
TARGET = logit_table(V, seed=1)
DRAFT = noisy(TARGET, seed=2, noise=1.0)
PROMPTS = [list(np.random.default_rng(s).integers(0, V, size=1 + s % 5)) for s in range(20)]
BUDGETS = [TreeBudget(1, 1, 1), TreeBudget(4, 3, 2), TreeBudget(8, 5, 3), TreeBudget(12, 8, 4)]


DEFAULT_BUDGET = TreeBudget()
FLAT = (1.0, 1.02, 1.05, 1.1, 1.2, 1.4)        # a GPU: 32 tokens cost little more than one
STEEP = (1.0, 1.75, 2.24, 3.5, 5.3, 9.2)       # a 2-core CPU: a second token costs 0.75
CHEAP_DRAFT = (0.05, 0.06, 0.07, 0.09, 0.12, 0.2)


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
    # the last step may have accepted past the limit, and the draft may have decoded the
    # target's own token after them (its next root): what the caches hold beyond the output
    # is the text greedy decoding goes on with
    written = prompt + _plain(prompt, 30 + 16)  # (further than one step reaches)
    assert written[:len(committed)] == committed
    target, draft = engine.target.ctx, engine.draft.ctx
    assert target.held(0) == written[: len(target.held(0))]
    assert len(target.held(0)) >= len(committed) - 1 - 8  # at most the last step's tail is pending
    assert {s for c in target.cells for s in c.seqs} == {0}  # no tree sequence left behind
    assert {s for c in draft.cells for s in c.seqs} == {0}
    assert draft.held(0) == written[: len(draft.held(0))]


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


def test_staged_greedy_grows_guessed_levels_with_their_side_branches() -> None:
    """Greedy staged trees grow every node whose answer a stage-2 guess already decoded, at any
    depth, with side branches (2 children per node here): several levels from one draft batch,
    far fewer batches than tree mode's one per level, the same exact output."""
    text = _plain([3, 4], 80)
    corpus = [[3, 4, *text]] * 3
    engine = _engine(Mode.STAGED, TreeBudget(10, 5, 2), corpus=corpus, draft=TARGET)
    engine.config = SpecConfig(mode=Mode.STAGED, tree=TreeBudget(10, 5, 2), lookahead=8,
                               adaptive=False)
    run = RunStats()
    assert _generate(engine, [3, 4], 60, run=run) == text[:60]
    assert any(s.draft_calls <= 2 and s.accepted >= 4 for s in run.steps)
    tree = _engine(Mode.TREE, TreeBudget(10, 5, 2), corpus=corpus, draft=TARGET, adaptive=False)
    tree_run = RunStats()
    assert _generate(tree, [3, 4], 60, run=tree_run) == text[:60]
    assert run.draft_calls_per_step < 0.6 * tree_run.draft_calls_per_step


def test_staged_sampling_grows_guessed_levels_with_their_side_branches() -> None:
    """Sampled, a drawn child the guess named is known at once and grows in the same way:
    fewer draft batches a step than tree mode's one per level (the old level-by-level growth
    saved none here, every level having an unguessed side branch). Same seeds, a draft that
    is the target, a low temperature at which the draws mostly follow the greedy text."""
    text = _plain([3, 4], 80)
    corpus = [[3, 4, *text]] * 3
    calls = {}
    for mode in (Mode.TREE, Mode.STAGED):
        engine = _engine(mode, TreeBudget(10, 5, 2), corpus=corpus, draft=TARGET)
        engine.config = SpecConfig(mode=mode, tree=TreeBudget(10, 5, 2), lookahead=8,
                                   adaptive=False)
        run = RunStats()
        for seed in range(4):
            _generate(engine, [3, 4], 40, params=SamplingParams(temperature=0.3, seed=seed),
                      run=run)
        calls[mode] = run.draft_calls_per_step
        assert run.tau > 3  # the draft is the target: trees are accepted deep
    assert calls[Mode.STAGED] < 0.6 * calls[Mode.TREE]


def test_a_guessed_bonus_token_starts_the_next_step_without_a_draft_batch() -> None:
    """When a stage-2 guess the draft decoded turns out to be the target's own token after the
    accepted path, the draft keeps it with its answer, and the next step's root costs no batch;
    the answer is the one decoding it would give."""
    from speculative.drafting import ModelDrafter
    from speculative.kvtree import KVTree

    text = _plain([3, 4], 12)
    ngram = KatzTrigram.build([[3, 4, *text]] * 3, V)
    kv = KVTree(FakeContext(DRAFT, n_ctx=64))
    drafter = ModelDrafter(kv, ngram, 4)
    drafter.begin([3, 4])  # the root and the n-gram's guesses after it: text[0..3]
    assert drafter.counters.calls == 1 and drafter.known((text[0], text[1])) is not None
    drafter.commit((text[0],), text[1])  # accepted text[0], the target wrote text[1]
    again = ModelDrafter(kv, ngram, 4)
    root = again.begin([3, 4, text[0], text[1]])
    assert again.counters.calls == 0
    fresh = KVTree(FakeContext(DRAFT, n_ctx=64))
    expected = ModelDrafter(fresh, None, 0).begin([3, 4, text[0], text[1]])
    assert np.allclose(root, expected)
    kv.prepare([3, 4, text[0], text[1], 7], max_pending=1)  # the text moves on: forgotten
    assert kv.tip_logits is None


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


class LoadedContext(FakeContext):
    """A fake target whose passes take ``load`` times a CPU-like cost curve (seconds)."""

    CURVE = VerifyCost((1, 2, 4, 8, 16, 32), tuple(0.004 * c for c in STEEP))

    def __init__(self, table: np.ndarray, **kw) -> None:
        super().__init__(table, **kw)
        self.load = 1.0

    def decode(self, tokens, positions, seq_ids, logits=True):
        import time

        out = super().decode(tokens, positions, seq_ids, logits)
        time.sleep(self.load * self.CURVE.curve(len(tokens)))
        return out


def test_the_estimated_speedup_follows_the_load_of_the_moment() -> None:
    """The counterfactual plain time of each step is read off its own target pass, so a
    machine that became three times slower after the models loaded does not fool the meter:
    plain reads 1.00x, and a tree mode reads what plain and it measure side by side."""
    target = LoadedContext(TARGET, n_ctx=256)
    ngram = KatzTrigram.build([list(np.random.default_rng(9).integers(0, V, 200))], V)
    engine = Engine(target, FakeContext(DRAFT, n_ctx=256), ngram,
                    SpecConfig(mode=Mode.PLAIN, tree=TreeBudget(8, 4, 2)))
    engine.verify_cost = LoadedContext.CURVE
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
    prompt = PROMPTS[3]

    def timed(mode: Mode) -> RunStats:
        engine.config = SpecConfig(mode=mode, tree=TreeBudget(8, 4, 2), adaptive=False)
        run = RunStats()
        _generate(engine, prompt, 40, run=run)
        return run

    timed(Mode.PLAIN)  # the loop's overhead is learned from plain steps
    target.load = 3.0  # the machine gets busy
    plain = timed(Mode.PLAIN)
    # a step with the target alone is its own counterfactual: exactly 1
    assert plain.estimated_speedup() == pytest.approx(1.0, rel=1e-9)
    tree = timed(Mode.TREE)
    side_by_side = tree.tokens_per_second / plain.tokens_per_second
    assert tree.estimated_speedup() == pytest.approx(side_by_side, rel=0.1)
    assert all(s.batch == s.drafted + 1 + s.redecoded for s in tree.steps)
    # a figure timed earlier at another load is only the fallback for steps without a curve
    assert tree.estimated_speedup(123.0) == tree.estimated_speedup()


def test_a_reply_that_ends_on_its_stop_token_reads_plain_speed_in_plain_mode() -> None:
    """The pass that produced the stop token took its time, and plain decoding would have
    taken it too: the counterfactual counts that token, so a short plain reply reads 1.00x
    and one token a pass (otherwise a pass slow: 9 tokens would read 0.90x)."""
    engine = Engine(LoadedContext(TARGET, n_ctx=256), FakeContext(DRAFT, n_ctx=256), None,
                    SpecConfig(mode=Mode.PLAIN))
    engine.verify_cost = LoadedContext.CURVE
    prompt = PROMPTS[3]
    _generate(engine, prompt, 20, run=RunStats())  # the loop's overhead is learned
    tokens = _plain(prompt, 20)
    end = next(i for i in range(4, 20) if tokens[i] not in tokens[:i])
    run = RunStats()
    assert _generate(engine, prompt, 20, stop={tokens[end]}, run=run) == tokens[:end]
    assert len(run.steps) == end + 1 and run.steps[-1].stopped == 1
    assert run.estimated_speedup() == pytest.approx(1.0, rel=1e-9)
    assert run.tau == pytest.approx(1.0)


class AttendingContext(LoadedContext):
    """A fake target whose passes also take 0.05 ms for every cell of context they attend to."""

    PER_CELL = 0.00005

    def decode(self, tokens, positions, seq_ids, logits=True):
        import time

        time.sleep(self.PER_CELL * len(self.cells))
        return super().decode(tokens, positions, seq_ids, logits)


def test_the_estimated_speedup_holds_in_a_long_context() -> None:
    """After a long context every pass costs more by the same time, so a tree's pass scaled by
    the curve timed after a short one would make plain look cheaper than it is: the meter reads
    the curve moved to the step's context. Each tree step's estimate of one plain token is
    compared with what plain steps took over the same contexts, just before (medians: single
    steps are noisy, whole-run timings more so)."""
    def estimate(per_context: float) -> float:
        target = AttendingContext(TARGET, n_ctx=256)
        ngram = KatzTrigram.build([list(np.random.default_rng(9).integers(0, V, 200))], V)
        engine = Engine(target, FakeContext(DRAFT, n_ctx=256), ngram,
                        SpecConfig(mode=Mode.PLAIN, tree=TreeBudget(8, 4, 2)))
        engine.verify_cost = dataclasses.replace(LoadedContext.CURVE, context=0,
                                                 per_context=(per_context, 0.0))
        engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
        prompt = list(np.random.default_rng(5).integers(0, V, 160))

        def run(mode: Mode) -> RunStats:
            engine.config = SpecConfig(mode=mode, tree=TreeBudget(8, 4, 2), adaptive=False)
            stats = RunStats()
            _generate(engine, prompt, 30, run=stats)
            return stats

        run(Mode.PLAIN)  # (warm: the loop's overhead around a plain pass is learned)
        plain = float(np.median([step.seconds for step in run(Mode.PLAIN).steps]))
        tree = [step.t_plain / (step.accepted + 1) for step in run(Mode.TREE).steps
                if step.batch > 1]
        return float(np.median(tree)) / plain

    assert estimate(AttendingContext.PER_CELL) == pytest.approx(1.0, rel=0.1)
    assert estimate(0.0) < 0.8  # the curve of a short context, wherever it is


def test_the_meter_counts_plain_time_only_for_the_tokens_a_step_keeps() -> None:
    """A step cut short by the token limit keeps fewer tokens than it accepted: plain decoding
    would have stopped there too, so the run's estimate counts plain time for the kept tokens
    only (the step's ``t_plain`` stays that of its accepted path; ``estimated_speedup``
    scales it)."""
    engine = _engine(Mode.TREE, TreeBudget(16, 8, 2), draft=TARGET)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), FLAT)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
    _generate(engine, PROMPTS[0], 30, run=RunStats())  # (the meter's overhead is learned)
    short = RunStats()
    _generate(engine, PROMPTS[0], 1, run=short)
    (step,) = short.steps
    assert step.accepted >= 3 and step.emitted == 1  # the target accepted more than it kept
    assert step.t_plain > 0
    # one token's share of the step's counterfactual, not the accepted path's (the share is
    # exact: a comparison with other steps' timings would measure the machine's load)
    assert short.plain_seconds() == pytest.approx(step.t_plain / (step.accepted + 1))
    assert short.estimated_speedup() == pytest.approx(short.plain_seconds() / short.seconds)


@pytest.mark.parametrize("mode", [Mode.TREE, Mode.STAGED])
def test_trees_grow_as_big_as_the_cost_curve_pays_for(mode: Mode) -> None:
    """A cheap, accurate drafter (the target itself): on a flat curve (a batch of 32 costs 1.4
    passes) deep, wide trees pay and are grown; on a steep one (a second token costs 0.75 of a
    pass) only small ones. The output is the target's either way."""
    drafted = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        engine = _engine(mode, TreeBudget(24, 10, 2), draft=TARGET)
        engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), curve)
        engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), CHEAP_DRAFT)
        run = RunStats()
        for prompt in PROMPTS[:6]:
            assert _generate(engine, prompt, 30, run=run) == _plain(prompt, 30)
        drafted[name] = run.mean_drafted
    assert drafted["flat"] >= 8 and drafted["steep"] <= 4


def test_caches_keep_the_text_another_engine_shared_and_forget_the_rest() -> None:
    """Another engine on the same contexts (the app's race) decodes the prompt from the start
    and writes a text of its own past it: the first engine's caches keep the prompt
    (``KVTree.keep``), every cell as they say, and its next turn is plain decoding's."""
    engine = _engine(Mode.STAGED, adaptive=False)
    prompt = PROMPTS[7]
    first = _generate(engine, prompt, 10)
    other = Engine(engine.target.ctx, engine.draft.ctx, KatzTrigram.build([[1, 2, 3]], V),
                   SpecConfig(mode=Mode.TREE, tree=TreeBudget(4, 3, 2)))
    drawn = _generate(other, prompt, 14, params=SamplingParams(temperature=1.0, seed=3))
    assert drawn[:10] != first  # another text sits where the first engine's was
    for cache in (engine.target, engine.draft):
        assert cache.ctx.held(0) != cache.tokens
        cache.keep(prompt)
        assert cache.tokens == prompt[:len(cache.tokens)] and cache.ctx.held(0) == cache.tokens
        assert all(c.seqs == {0} for c in cache.ctx.cells)
    turn = [*prompt, *first, 5]
    assert _generate(engine, turn, 12) == _plain(turn, 12)
    assert engine.target.ctx.held(0) == engine.target.tokens


def _priced(mode: Mode, target_cost: tuple, draft_cost: tuple,
            corpus: list[list[int]] | None) -> RunStats:
    """An adaptive run of ``mode`` on the given curves, with a draft that agrees with the
    target; its steps."""
    from speculative.costmodel import VerifyCost

    engine = _engine(mode, TreeBudget(12, 6, 2), corpus=corpus, draft=TARGET)
    engine.verify_cost = VerifyCost((1, 2, 4, 8, 16, 32), target_cost)
    engine.draft_cost = VerifyCost((1, 2, 4, 8, 16, 32), draft_cost)
    run = RunStats()
    assert _generate(engine, [3, 4], 48, run=run) == _plain([3, 4], 48)
    return run


def test_stage2_guesses_priced_by_the_batches_they_save_still_cut_batches_on_a_flat_curve(
        ) -> None:
    """Guesses are credited with the draft batches they saved, not the nodes they answered.
    Where the n-gram knows the text, a wider draft batch costs little more (a flat draft
    curve) and deep trees pay (a flat target curve), the guesses keep riding along, sized by
    the sizer, and cut the draft's batches by at least 40% against tree mode."""
    text = _plain([3, 4], 60)
    knows = [[3, 4, *text]] * 3
    tree = _priced(Mode.TREE, FLAT, CHEAP_DRAFT, knows)
    staged = _priced(Mode.STAGED, FLAT, CHEAP_DRAFT, knows)
    assert staged.draft_calls_per_step <= 0.6 * tree.draft_calls_per_step
    assert sum(s.stage2_proposed for s in staged.steps[len(staged.steps) // 2:]) > 0
