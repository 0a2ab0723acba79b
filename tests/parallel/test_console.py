"""The console helper undoes the launcher's chunking: words a person reads are checked on whole
lines, whatever chunk boundaries the launcher chose."""
import sys

from jobs import Console, horovodrun, run


def test_tags_inside_a_line_are_removed_per_rank_and_stream():
    text = ('launcher says hi\n[1,0]<stdout>:{"a": 1, "b"[1,1]<stdout>:rank one\n'
            '[1,0]<stdout>:: 2}\n[1,0]<stderr>:warn[1,0]<stderr>:ing\n')
    seen = Console(text)
    assert seen.launcher == "launcher says hi\n"
    assert seen.streams[(0, "stdout")] == '{"a": 1, "b": 2}\n'
    assert seen.streams[(0, "stderr")] == "warning\n"
    assert seen.rank(1) == "rank one\n\n" and seen.ranks() == [0, 1]
    # Gloo mode tags with the rank alone.
    assert Console("[3]<stdout>:x[3]<stdout>:y").rank(3) == "xy\n"


def test_long_lines_from_two_ranks_come_back_whole():
    # Lines far longer than a forwarding chunk, printed by both ranks at once.
    code = ("import os; r = int(os.environ['OMPI_COMM_WORLD_RANK']); "
            "print(str(r) * 200000, flush=True); print('done', r, flush=True)")
    proc = run(horovodrun(2, sys.executable, "-c", code))
    seen = Console.of(proc)
    for r in (0, 1):
        lines = seen.streams[(r, "stdout")].splitlines()
        assert lines == [str(r) * 200000, f"done {r}"], [len(line) for line in lines]
