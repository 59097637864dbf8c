"""The desktop app, driven through its signals with the real built-in models (offscreen Qt)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from app.main import open_window
from app.tools.cli import main as cli_main
from app.ui.main_window import MainWindow
from app.worker.messages import StepEvent

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
LOAD_MS = 120_000
REPLY_MS = 120_000


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


def _open(qtbot, data_dir: Path, **overrides) -> MainWindow:
    settings = {"temperature": 0.0, "max_tokens": 24, "mode": "staged", "seed": 0, **overrides}
    window = open_window(data_dir, settings)
    qtbot.addWidget(window)
    if window.info is None:
        with qtbot.waitSignal(window.models_loaded, timeout=LOAD_MS):
            pass
    return window


@pytest.fixture()
def window(qtbot, data_dir: Path):
    w = _open(qtbot, data_dir)
    yield w
    w.close()


def _reply(qtbot, window: MainWindow, text: str) -> list[StepEvent]:
    """Send ``text`` and wait for the stored reply; the step events that streamed."""
    steps: list[StepEvent] = []
    window.step_shown.connect(steps.append)
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
        assert window.send_text(text) is not None
    window.step_shown.disconnect(steps.append)
    return steps


def _last_reply(window: MainWindow):
    assert window.conversation is not None
    return window.history.messages(window.conversation.id)[-1]


def test_streamed_reply_equals_the_command_line(qtbot, window: MainWindow, capsys) -> None:
    steps = _reply(qtbot, window, PROMPT)
    reply = _last_reply(window)
    assert reply.role == "assistant" and reply.text
    streamed = "".join(text for ev in steps for text, _ in ev.pieces)
    assert streamed == reply.text
    assert window.chat.last_reply_text() == reply.text
    assert cli_main(["generate", "--json", "--mode", "staged", "-n", "24", "--prompt", PROMPT,
                     "--threads", "1"]) == 0
    cli = json.loads(capsys.readouterr().out)
    # the app stops where a new top-level statement starts; until then it is the CLI's text
    assert cli["text"].startswith(reply.text)
    assert reply.tokens == cli["tokens"][:len(reply.tokens)]
    if reply.finish == "length":
        assert reply.text == cli["text"]
    assert len(reply.origins) == len(reply.tokens)


def test_statistics_arrive_while_the_reply_streams(qtbot, window: MainWindow) -> None:
    seen_during: list[str] = []
    statuses: set[str] = set()

    def peek(_ev: StepEvent) -> None:  # runs on the GUI thread, before the reply is stored
        window.replies.draw()
        seen_during.append(window.stats.speed.value.text())
        statuses.add(window.status.text())

    window.step_shown.connect(peek)
    _reply(qtbot, window, PROMPT)
    # the status bar says the reply is being written, and stops saying so when it is stored
    # (not only once the worker has put away what the engine learned)
    assert statuses == {"Generating…"}
    assert window.status.text() in ("Ready", "Measuring the target's speed again…")
    assert len(seen_during) >= 2
    assert any(text not in ("", "\u2013") for text in seen_during[1:])  # an en dash: no value yet
    assert window.stats.run.steps and window.stats.run.tokens == len(_last_reply(window).tokens)


def test_stop_mid_generation_keeps_the_partial_reply(qtbot, data_dir: Path) -> None:
    window = _open(qtbot, data_dir, max_tokens=400, mode="tree")
    first = []

    def stop_after_two(ev: StepEvent) -> None:
        first.append(ev)
        if len(first) == 2:
            window.stop()

    window.step_shown.connect(stop_after_two)
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
        window.send_text("class Stack:\n")
    reply = _last_reply(window)
    assert reply.finish == "cancelled"
    assert 0 < len(reply.tokens) < 400
    assert window.send_button.text() == "Send"  # idle again, and usable:
    window.step_shown.disconnect(stop_after_two)
    window.apply_settings(dataclasses.replace(window.settings, max_tokens=8))
    _reply(qtbot, window, "import os\n")
    assert _last_reply(window).finish in ("length", "stop")
    window.close()


def test_switching_stages_between_replies_changes_the_statistics(qtbot, data_dir: Path) -> None:
    window = _open(qtbot, data_dir, mode="plain")
    _reply(qtbot, window, PROMPT)
    plain = _last_reply(window)
    assert plain.mode == "plain" and plain.stats["origins"]["draft"] == 0
    assert plain.stats["tau"] == 1.0
    window.mode_combo.setCurrentIndex(window.mode_combo.findData("tree"))
    assert window.settings.mode == "tree"
    window.regenerate()
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
        pass
    tree = _last_reply(window)
    assert tree.mode == "tree" and tree.stats["origins"]["draft"] > 0
    assert tree.stats["tau"] > 1.0
    assert tree.text == plain.text  # greedy: every mode writes the target's own text
    window.close()


def test_a_race_finishes_with_identical_texts_at_temperature_0(qtbot, window: MainWindow) -> None:
    _reply(qtbot, window, PROMPT)
    with qtbot.waitSignal(window.race_done, timeout=REPLY_MS):
        window.race()
    race = window.race_window
    assert race is not None and race.result is not None
    result = race.result
    assert result.plain.mode == "plain" and result.speculative.mode == "staged"
    assert result.identical and result.plain.tokens
    assert result.speedup > 0
    # the built-in pair writes a reply in well under a second: the race ran more rounds,
    # alternating which side went first, until each side's pooled time was RACE_SECONDS or more
    from app.worker.racing import MAX_ROUNDS, RACE_SECONDS
    n = result.tokens
    pooled = [result.plain.run.seconds_until(n), result.speculative.run.seconds_until(n)]
    assert min(pooled) < RACE_SECONDS and 1 <= len(result.rounds) <= MAX_ROUNDS
    assert all(p > 0 and q > 0 for p, q in result.rounds)
    pooled = [pooled[0] + sum(p for p, _ in result.rounds),
              pooled[1] + sum(q for _, q in result.rounds)]
    assert min(pooled) >= RACE_SECONDS or len(result.rounds) == MAX_ROUNDS
    with qtbot.waitSignal(race.replay_finished, timeout=60_000):
        race.finish_now()
    assert race.left.text.toPlainText().endswith(result.plain.text)
    assert "identical" in race.verdict.text()
    ups = result.round_speedups()
    assert len(ups) == len(result.rounds) + 1 and min(ups) <= result.speedup <= max(ups)
    assert (f"pooled over {len(result.rounds) + 1} rounds, each {min(ups):.2f}-{max(ups):.2f}"
            f"\u00d7" in race.verdict.text())


def test_a_sampled_race_compares_runs_of_the_same_length(qtbot, data_dir: Path) -> None:
    """At temperature 0.7 each run is its own draw: neither stops at its own end of text, both
    write the raced reply's length (the tokens the meter estimated), and the verdict (shown
    beside the estimated meter too) compares the time each took for those tokens."""
    window = _open(qtbot, data_dir, temperature=0.7, max_tokens=60, mode="auto")
    _reply(qtbot, window, PROMPT)
    n = len(_last_reply(window).tokens)
    with qtbot.waitSignal(window.race_done, timeout=REPLY_MS):
        window.race()
    result = window.race_window.result
    assert len(result.plain.tokens) == len(result.speculative.tokens) == result.tokens == n
    plain = result.plain.run.seconds + sum(p for p, _ in result.rounds)
    spec = result.speculative.run.seconds + sum(s for _, s in result.rounds)
    assert result.speedup == pytest.approx(plain / spec)
    assert f"{result.speedup:.2f}\u00d7 plain, measured over {n} tokens" in \
        window.stats.race_note.text()
    window.close()


def test_a_race_replays_the_reply_without_knowing_its_text(qtbot, data_dir: Path) -> None:
    """The race's speculation starts where the reply did: its n-gram model has not learned the
    reply's text (the app's has: it learns every text it writes), so a fixed-size n-gram tree
    takes the same tokens step for step as in the reply; and every further round replays it
    the same way, rather than knowing the text by then."""
    from app.replies import stored_run

    window = _open(qtbot, data_dir, mode="ngram", adaptive=False, max_tokens=48)
    _reply(qtbot, window, PROMPT)
    reply = _last_reply(window)
    run = stored_run(reply.stats)
    assert run is not None and len(run.steps) > 2
    with qtbot.waitSignal(window.race_done, timeout=REPLY_MS):
        window.race()
    result = window.race_window.result
    raced = result.speculative
    assert raced.tokens[:len(reply.tokens)] == reply.tokens
    whole = run.steps[:-1]  # the reply's last step may end at a stop mid-way
    assert [s.accepted for s in raced.run.steps[:len(whole)]] == [s.accepted for s in whole]
    assert any(s.accepted < s.drafted for s in whole)  # there was something left to learn
    window.close()


def test_the_apps_engine_learns_nothing_from_a_race(qtbot, data_dir: Path) -> None:
    """Many runs of one prompt would tilt what ``auto`` knows of chat in general: the engine
    that writes the replies is as the reply left it, and writes the same text after the race
    (the race's engines used its contexts: its caches kept the prompt and forgot the rest)."""
    window = _open(qtbot, data_dir, mode="auto", max_tokens=32)
    _reply(qtbot, window, PROMPT)
    first = _last_reply(window).text
    engine = window.controller.worker._engine

    def learned() -> str:  # of chat (the machine's passes, timed by every engine, aside)
        return json.dumps({k: v for k, v in engine.memory().items() if k != "drafted_factor"},
                          sort_keys=True)

    before = learned()
    with qtbot.waitSignal(window.race_done, timeout=REPLY_MS):
        window.race()
    assert window.race_window.result.rounds  # several runs of the prompt
    assert learned() == before
    window.regenerate()
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
        pass
    assert _last_reply(window).text == first
    window.close()


def test_a_race_stopped_midway_leaves_the_app_writing_as_before(qtbot, data_dir: Path) -> None:
    """Stop pressed while the race's speculative run writes: the race says it could not
    finish, the window is idle, and the next reply is the same text as before the race (the
    race's engines had written into the contexts: the app's caches kept the prompt only)."""
    window = _open(qtbot, data_dir, max_tokens=64)
    _reply(qtbot, window, PROMPT)
    first = _last_reply(window).text

    def stop_midway(_request_id: int, mode: str, tokens: int) -> None:
        if mode != "plain" and tokens >= 4:
            window.stop()

    window.controller.worker.race_progress.connect(stop_midway)
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
        window.race()
    window.controller.worker.race_progress.disconnect(stop_midway)
    assert window.race_window.result is None
    assert "could not finish" in window.race_window.status.text()
    assert window.send_button.text() == "Send"
    window.regenerate()
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
        pass
    assert _last_reply(window).text == first
    window.close()


@pytest.mark.parametrize("tie", [True, False])
def test_a_race_whose_texts_part_says_whether_at_a_tie(qtbot, tie: bool) -> None:
    """Greedy texts that differ: the race says where, and whether the target's own logits tie
    there (llama.cpp's batch shapes) or not (an error to report)."""
    from app.ui.race import RaceWindow
    from app.worker.messages import RaceResult, RaceRun
    from speculative.divergence import Divergence
    from speculative.stats import RunStats

    def run(mode: str, text: str, tokens: list[int]) -> RaceRun:
        return RaceRun(mode, text, tokens, [(0.0, text)], RunStats())

    why = Divergence(2, 11, 12, {"as plain ran": 0.01, "every token alone": -0.01}, tie)
    result = RaceResult(1, run("plain", "abc", [1, 2, 11]), run("auto", "abd", [1, 2, 12]), why)
    race = RaceWindow(monospace=True)
    qtbot.addWidget(race)
    race.show_result(result, "prompt")
    with qtbot.waitSignal(race.replay_finished, timeout=60_000):
        race.finish_now()
    assert "from token 2" in race.status.text()
    if tie:
        assert "tie" in race.status.text() and "part at a tie" in race.verdict.text()
    else:
        assert "NOT at a tie" in race.status.text() and "NOT identical" in race.verdict.text()


def test_a_sampled_race_says_its_texts_are_two_draws(qtbot) -> None:
    from app.ui.race import RaceWindow
    from app.worker.messages import RaceResult, RaceRun
    from speculative.stats import RunStats

    def run(mode: str, text: str, tokens: list[int]) -> RaceRun:
        return RaceRun(mode, text, tokens, [(0.0, text)], RunStats())

    result = RaceResult(1, run("plain", "abc", [1, 2, 11]), run("auto", "abd", [1, 2, 12]),
                        None, temperature=0.7)
    race = RaceWindow(monospace=True)
    qtbot.addWidget(race)
    race.show_result(result, "prompt")
    with qtbot.waitSignal(race.replay_finished, timeout=60_000):
        race.finish_now()
    assert "temperature 0.7" in race.status.text() and "draw" in race.status.text()
    assert "two samples" in race.verdict.text() and "NOT" not in race.verdict.text()


def test_history_survives_closing_and_reopening(qtbot, data_dir: Path) -> None:
    window = _open(qtbot, data_dir)
    _reply(qtbot, window, PROMPT)
    reply = _last_reply(window).text
    window.close()
    again = _open(qtbot, data_dir)
    assert [c.title for c in again.list_model.items] == [PROMPT.split("\n")[0] + ' """Return '
                                                         'the n-th Fibonacci number."""']
    texts = [again.chat.plain_text_of(i) for i in range(len(again.chat.messages))]
    assert texts == [PROMPT, reply]
    again.close()


def test_a_corrupt_model_file_shows_an_error_and_the_app_keeps_working(
        qtbot, window: MainWindow, tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    with qtbot.waitSignal(window.load_failed, timeout=LOAD_MS):
        window.apply_settings(dataclasses.replace(window.settings, target_path=str(bad),
                                                  draft_path="", mode="ngram"))
    assert "broken.gguf" in window.banner.text()
    with qtbot.waitSignal(window.models_loaded, timeout=LOAD_MS):
        window.apply_settings(dataclasses.replace(window.settings, target_path="",
                                                  mode="staged"))
    _reply(qtbot, window, PROMPT)
    assert _last_reply(window).role == "assistant"


def test_about_box_names_the_versions_and_the_theme_follows_a_switch(qtbot, window) -> None:
    from app.ui.main_window import about_text

    text = about_text(window.info)
    assert "Staged Chat" in text and "PySide6" in text and "llama-cpp-python" in text
    assert window.info is not None and window.info.system and "llama.cpp:" in text
    from PySide6.QtGui import QPalette

    def base_lightness() -> int:
        qtbot.wait(20)  # palette changes reach the widgets as events
        return window.chat.palette().color(QPalette.ColorRole.Base).lightness()

    dark = dataclasses.replace(window.settings, theme="dark")
    window.apply_settings(dark)
    assert base_lightness() < 80
    window.apply_settings(dataclasses.replace(dark, theme="light"))
    assert base_lightness() > 200


def test_the_built_in_target_chosen_by_its_file_still_completes_code(qtbot, data_dir) -> None:
    from models.catalog import builtin_pair

    target, draft = builtin_pair()
    window = _open(qtbot, data_dir, target_path=str(target), draft_path=str(draft))
    assert window.info is not None and window.info.builtin
    assert window._format() == "code"
    window.close()


def _panel(window: MainWindow) -> dict:
    """What the statistics panel shows: meters, bars, the detail line, the chart."""
    s = window.stats
    return {"meters": [m.value.text() for m in (s.speed, s.speedup, s.tau)],
            "detail": s.detail.text(), "depth": s.depth.rates, "origins": s.origins.values,
            "time": s.time.values, "chart": _chart(window),
            "ranges": [(a.min(), a.max()) for a in (s.x_axis, s.speed_axis, s.tau_axis)]}


def _chart(window: MainWindow) -> list[list[tuple[float, float]]]:
    return [[(p.x(), p.y()) for p in (series.at(i) for i in range(series.count()))]
            for series in (window.stats.speed_series, window.stats.tau_series)]


def _covered(window: MainWindow) -> None:
    """Every point on the chart lies within its axes' ranges."""
    s = window.stats
    speed, tau = _chart(window)
    if not speed:
        return
    assert s.x_axis.min() <= min(x for x, _ in speed) and max(x for x, _ in speed) <= s.x_axis.max()
    assert max(y for _, y in speed) <= s.speed_axis.max()
    assert max(y for _, y in tau) <= s.tau_axis.max()


def test_a_reopened_conversation_shows_the_statistics_and_chart_it_was_written_with(
        qtbot, data_dir: Path) -> None:
    window = _open(qtbot, data_dir, mode="tree")
    live: list = []

    def drawn(_ev: StepEvent) -> None:  # the chart as it streams, step by step
        window.replies.draw()
        live.append(_chart(window))
        _covered(window)

    window.step_shown.connect(drawn)
    _reply(qtbot, window, PROMPT)
    assert live[-1] == _chart(window)  # streamed, then rebuilt from the history: the same
    assert live[-1][0]
    _covered(window)
    _reply(qtbot, window, "\n\ndef main():\n")
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
        window.continue_reply()
    assert live[-1] == _chart(window)
    _covered(window)
    replies = [m for m in window.history.messages(window.conversation.id)
               if m.role == "assistant"]
    assert len(replies) == 2 and replies[-1].finish in ("stop", "length", "context")
    written = _panel(window)
    steps = sum(r.stats["target_passes"] for r in replies)
    assert len(written["chart"][0]) == steps > 2  # a point per step of every reply
    # the axes' labels whole, whatever the ranges grow to (truncated, "300" read "...")
    s = window.stats
    assert not any(a.truncateLabels() for a in (s.x_axis, s.speed_axis, s.tau_axis))
    assert written["meters"][2] == f"{replies[-1].stats['tau']:.2f}"
    assert "\u2013" not in written["meters"]  # an en dash: no value
    assert f"in {replies[-1].stats['target_passes']} target passes" in written["detail"]
    footers = [m.footer for m in window.chat.messages]
    window.close()
    again = _open(qtbot, data_dir, mode="tree")
    assert _panel(again) == written
    assert [m.footer for m in again.chat.messages] == footers
    again.close()


def test_a_reply_stored_before_steps_were_kept_shows_its_stored_figures(
        qtbot, data_dir: Path) -> None:
    """An older history holds a reply's summary only: it is shown as stored, and no steps are
    made up (once, a made-up single step showed 196 tokens per target pass)."""
    from app.history import History

    data_dir.mkdir(parents=True)
    stored = {"mode": "auto", "tokens": 196, "target_passes": 183, "tau": 1.07,
              "mean_accepted": 0.07, "mean_drafted": 0.24, "depth_acceptance": [0.3, 0.1],
              "origins": {"draft": 9, "ngram": 4, "target": 183}, "draft_calls_per_step": 0.2,
              "stage2_hit_rate": 0.0, "tokens_per_second": 51.5, "estimated_speedup": 1.04,
              "time": {"prefill": 0.01, "draft": 0.2, "stage2": 0.05, "verify": 3.4,
                       "other": 0.15}, "origin_runs": [[4, "target"]], "format": "code"}
    with History(data_dir / "history.sqlite3") as history:
        c = history.create_conversation("old", prompt_format="code")
        history.add_message(c.id, "user", PROMPT)
        history.add_message(c.id, "assistant", "    pass\n", tokens=list(range(196)),
                            origins=["target"] * 196, finish="length", stats=stored,
                            mode="auto")
    window = _open(qtbot, data_dir)
    shown = _panel(window)
    assert shown["meters"] == ["52", "1.04\u00d7", "1.07"]
    assert shown["detail"].startswith("auto: 196 tokens in 183 target passes; 0.2 drafted")
    assert shown["depth"] == [0.3, 0.1] and shown["chart"] == [[], []]
    assert "1.07" in window.chat.messages[-1].footer
    window.close()


def test_an_exported_conversation_shows_every_figure_the_window_shows(
        qtbot, window: MainWindow, tmp_path: Path) -> None:
    _reply(qtbot, window, PROMPT)
    line = window.chat.messages[-1].footer
    assert "\u2248" in line and "tok/s" in line  # the estimated speedup is among them
    path = tmp_path / "chat.md"
    assert window.conversation is not None
    window.export(window.conversation.id, "markdown", str(path))
    assert f"*{line}*" in path.read_text("utf-8")


def test_keyboard_focus_starts_in_the_message_box(qtbot, data_dir: Path) -> None:
    window = _open(qtbot, data_dir)
    window.show()
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.focusWidget() is not None, timeout=5_000)
    assert QApplication.focusWidget() is window.input
    window.close()


LOOPING = ('def longest_word(sentence: str) -> str:\n'
           '    """Return the longest word in sentence."""\n')


def test_repetition_control_follows_the_chat_and_says_what_it_changed(qtbot,
                                                                        data_dir: Path) -> None:
    """A chat in the code format replies with the format's penalties (the settings' default
    choice); the stored reply says how many tokens they steered; a chat that switches them off
    keeps its choice, also after reopening, and its next reply is the target's own greedy text
    (the built-in target loops on this prompt without them)."""
    from app.prompting import CODE
    from speculative.sampling import SamplingParams

    window = _open(qtbot, data_dir, max_tokens=48)
    assert window.settings.repetition == "format"
    assert window.chat_settings().sampling(0, CODE).penalized
    _reply(qtbot, window, LOOPING)
    penalised = _last_reply(window)
    steered = penalised.stats["penalties"]["steered"]
    assert steered > 0
    assert f"penalties steered {steered}" in window.chat.messages[-1].footer
    assert "Penalties changed the target's top token" in window.stats.detail.text()
    conversation = window.conversation.id
    window.repetition_combo.setCurrentIndex(window.repetition_combo.findData("off"))
    assert window.history.conversation(conversation).settings["chat_repetition"] == "off"
    assert window.settings.repetition == "format"  # the app's default is untouched
    window.new_conversation()
    assert window.repetition_combo.currentData() == "format"
    window.open_conversation(conversation)
    assert window.repetition_combo.currentData() == "off"
    assert window.chat_settings().sampling(0, CODE) == SamplingParams(0.0, 40, 0.95, 0)
    _reply(qtbot, window, LOOPING)
    plain = _last_reply(window)
    assert plain.stats["penalties"]["steered"] == 0
    assert plain.text != penalised.text
    window.close()


def test_the_settings_dialog_edits_the_repetition_control(qtbot, window: MainWindow) -> None:
    from app.ui.settings_dialog import SettingsDialog

    dialog = SettingsDialog(window.settings, window)
    qtbot.addWidget(dialog)
    seen = []
    dialog.changed.connect(seen.append)
    assert not dialog.dry_multiplier.isEnabled()  # the format's defaults: shown, not edited
    assert "Code completion: repeat penalty" in dialog.format_defaults.text()
    dialog.repetition.setCurrentIndex(dialog.repetition.findData("custom"))
    assert dialog.dry_multiplier.isEnabled()
    dialog.dry_multiplier.setValue(1.5)
    dialog.repeat_penalty.setValue(1.2)
    assert seen[-1].repetition == "custom"
    params = seen[-1].sampling(3)
    assert (params.dry_multiplier, params.repeat_penalty, params.seed) == (1.5, 1.2, 3)


def test_a_restarted_app_starts_from_what_the_last_run_learned(qtbot, data_dir: Path) -> None:
    """``auto`` measures which kind of step is fastest on this machine; after each reply that
    is kept beside the cost curves, and the next start of the app on the same models takes
    it up, so that its first reply does not pay to find it again."""
    from speculative.loading import learned_path

    window = _open(qtbot, data_dir, mode="auto")
    _reply(qtbot, window, PROMPT)
    worker = window.controller.worker
    key = worker._pair.memory_key()
    learned = worker._engine.planner
    assert learned is not None and learned.held is not None
    kept = json.loads(learned_path().read_text())[key]["memory"]
    assert "greedy" in kept["planner"]["sampling"]
    window.close()

    again = _open(qtbot, data_dir, mode="auto")
    planner = again.controller.worker._engine.planner
    assert planner is not None and planner.elapsed == 0  # nothing measured of its own yet
    planner.new_text(greedy=True)  # as its first greedy reply begins: the last run's measures
    assert planner.held is learned.held
    assert [r.measured for r in planner.rates.values()] == [
        r.measured for r in learned.rates.values()]
    _reply(qtbot, again, "import os\n")
    assert again.controller.worker._engine.planner.elapsed > 0
    again.close()


def test_each_model_decodes_on_the_threads_measured_fastest_here_unless_the_user_says(
        qtbot, data_dir: Path) -> None:
    """Left to the app, each model's thread count is one of its choices (every core, or one
    fewer for the window), as measured on this machine, and the window says which; a count
    the user set is every model's."""
    from app.worker.loading import app_threads

    chosen = _open(qtbot, data_dir)
    info = chosen.info
    assert info is not None and info.draft is not None
    assert set(info.threads) <= set(app_threads())
    assert info.threads_text() in chosen.model_label.text()
    chosen.close()
    set_by_user = _open(qtbot, data_dir, threads=1)
    assert set_by_user.info is not None and set_by_user.info.threads == (1, 1)
    assert "1 thread " in set_by_user.model_label.text()
    set_by_user.close()
