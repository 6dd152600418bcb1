"""The progress bar (fastdecode.util.progress): drawn on a terminal, silent elsewhere."""

import io

from rich.console import Console

from fastdecode.util.progress import progress_bar, track


def test_a_terminal_gets_a_bar_that_reaches_the_total():
    out = io.StringIO()
    with progress_bar("wanda: decoder layers", 3, enabled=True, console=Console(file=out, force_terminal=True)) as step:
        for _ in range(3):
            step()
    assert "wanda: decoder layers" in out.getvalue() and "3/3" in out.getvalue()


def test_no_terminal_no_bar(capsys):
    with progress_bar("magnitude: decoder layers", 2) as step:  # stderr captured: not a terminal
        step()
        step()
    assert capsys.readouterr().err == ""


def test_track_yields_every_item_and_stays_silent_off_a_terminal(capsys):
    assert list(track([3, 1, 2], "gptq: decoder layers")) == [3, 1, 2]
    assert capsys.readouterr().err == ""
