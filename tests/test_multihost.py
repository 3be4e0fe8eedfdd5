"""The sharded update (Muon, Dion) in 2 processes × 4 CPU devices
(jax.distributed, gloo) equals the single-process result."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytestmark = (
    pytest.mark.slow
)  # compiles or trains real models: the full suite only

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_single_process():
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
      subprocess.Popen(
          [sys.executable, str(WORKER), port, str(i)],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in range(2)
  ]
  outputs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=300)
      outputs.append(out)
  finally:
    for p in procs:
      p.kill()
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, out[-3000:]
    # Muon with whole matrices and with teams; Dion; Dion with a replica per
    # process, syncing rank-r factors across the processes.
    for name in ("whole", "teams", "dion", "dion-replicas"):
      assert (
          f"MULTIHOST {name} process {i}: max relative difference" in out
      ), out[-3000:]
