"""Importing onto fsdp=4 x tensor=2 as 4 processes x 2 CPU devices: no process holds the whole model.

Each process reads only the slices of its two devices' shards, so its peak
resident memory grows during the import by far less than the checkpoint's
size (29 MB here).  Measured with ``resource.getrusage(...).ru_maxrss`` just
before and after ``load_params``, after JAX started and made its first
transfer (its own allocations are outside the window).  On CPU the "device"
buffers are host memory too, so the growth includes the process's quarter of
the model (7.4 MB) plus one parameter's slices in flight and the pages of the
tensor being read; an import that read whole tensors, or the whole model,
into every process would grow by at least the checkpoint's size.
Observed on this machine: 8.0-10.4 MB per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.checkpoint.procs import REPO, env_for, free_port
from tests.hf.reference import LLAMA, hf_tensors, write_checkpoint

WORKER = Path(__file__).with_name("import_worker.py")
TIMEOUT_S = 180  # a loaded machine; a healthy group takes ~10 s
BIG = dict(
    LLAMA,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=8192,
)


def test_each_process_holds_less_than_the_checkpoint(tmp_path):
    hf_dir = write_checkpoint(tmp_path / "big", BIG, hf_tensors(BIG))
    total = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    assert total > 25e6
    port, procs = free_port(), []
    logs = [tmp_path / f"p{i}.log" for i in range(4)]
    try:
        for i in range(4):
            with open(logs[i], "w") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(hf_dir)],
                        cwd=REPO,
                        env=env_for(i, 4, 2, port),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )
        for i, p in enumerate(procs):
            assert p.wait(timeout=TIMEOUT_S) == 0, logs[i].read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    results = []
    for log in logs:
        lines = [l for l in log.read_text().splitlines() if l.startswith("RESULT ")]
        assert lines, log.read_text()[-3000:]
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    assert len({d for r in results for d in r["devices"]}) == 8  # 4 processes x 2 devices of their own
    for r in results:
        assert r["held"] < total / 3  # a quarter of the model (norms replicated)
        assert r["growth"] < total, (r, total)
    print({"checkpoint_bytes": total, "growth": [r["growth"] for r in results], "held": [r["held"] for r in results]})
