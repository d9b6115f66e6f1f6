"""`jaxdist ckpt list | inspect | verify | plan` on a run directory."""

from jaxdist.checkpoint import integrity
from jaxdist.cli import main

from .test_integrity import biggest_data_file, saved


def run(capsys, *argv):
    rc = main(["ckpt", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_ckpt_commands(tmp_path, capsys):
    saved(tmp_path, steps=(1, 2, 3)).close()
    ck = tmp_path / "ck"
    (ck / "3" / integrity.COMMIT_FILE).unlink()  # an interrupted save
    victim = biggest_data_file(ck / "2")
    victim.write_bytes(victim.read_bytes()[:-3])  # a truncated file

    rc, out, _ = run(capsys, "list", str(ck))
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:3] == ["step", "state", "procs"]
    assert [l.split()[:2] for l in lines[1:]] == [["1", "committed"], ["2", "committed"], ["3", "incomplete"]]
    marker = integrity.read_commit(ck / "1")
    assert f"{sum(marker['bytes_written_per_process']):,}" in lines[1]

    rc, out, _ = run(capsys, "verify", str(ck))
    rel = victim.relative_to(ck / "2").as_posix()
    assert rc == 1
    assert "step 1: ok" in out and f"step 2: DAMAGED ({ck / '2'})" in out
    size = integrity.read_commit(ck / "2")["files"][rel]["size"]
    assert f"  {rel} has {size - 3} bytes, {size} were written" in out
    assert "step 3: incomplete (3), not a checkpoint" in out
    assert run(capsys, "verify", str(ck), "--step", "1")[0] == 0

    rc, out, _ = run(capsys, "inspect", str(ck), "--step", "1")
    assert rc == 0 and "step 1, 1 processes, strategy balanced" in out
    assert any(l.split()[:3] == ["w", "(8,", "8)"] for l in out.splitlines())
    assert "mesh: data=2 fsdp=4" in out

    rc, out, _ = run(capsys, "plan", str(ck), "--step", "1")
    planned = marker["planned_bytes_per_process"]
    assert rc == 0 and "total (balanced)" in out and f"{planned[0]:,}" in out
    assert "max/mean bytes per process: 1.0000" in out

    rc, _, err = run(capsys, "inspect", str(ck), "--step", "7")
    assert rc == 2 and err == f"jaxdist: {ck} has no committed checkpoint of step 7: see `jaxdist ckpt list`.\n"
    rc, _, err = run(capsys, "list", str(tmp_path / "nowhere"))
    assert rc == 2 and "is neither a run directory nor a checkpoint directory" in err
    rc, _, err = run(capsys, "list", str(ck), "train.steps=3")
    assert rc == 2 and "takes no overrides" in err
