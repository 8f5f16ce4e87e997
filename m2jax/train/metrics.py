"""Where metrics go: WORKDIR/metrics.jsonl, TensorBoard, and MFU arithmetic.

metrics.jsonl holds one JSON object per logged step ({"step", "loss", ...})
and eval lines ({"step", "val_loss", "val_bpb"}). On resume the lines past
the restored step are dropped, so the file reads as one uninterrupted run:
no step is logged twice, whether the run was killed between a logged step
and its checkpoint, stopped by a signal, or fell back to an older checkpoint.
"""

from __future__ import annotations

import json
import math
import os

import jax

# Dense bf16 peak of one chip (vendor datasheets), for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops() -> float | None:
  """Peak bf16 FLOP/s of the first device, None when unknown (CPU)."""
  kind = jax.devices()[0].device_kind
  for name, peak in PEAK_BF16_FLOPS.items():
    if name in kind:
      return peak
  return None


class MetricsWriter:
  """Appends to metrics.jsonl and writes TensorBoard scalars."""

  def __init__(self, workdir: str, *, resume_step: int | None = None,
               tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    if resume_step is not None and os.path.exists(self.path):
      self._truncate_after(resume_step)
    elif resume_step is None and os.path.exists(self.path):
      os.remove(self.path)
    self._file = open(self.path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def _truncate_after(self, step: int) -> None:
    """Keep the lines up to `step`, the restored checkpoint's: the steps
    after it are trained (and logged) again. A line that does not parse is
    the last one, cut by a kill mid-write: dropped too."""
    keep = []
    with open(self.path, encoding="utf-8") as f:
      for line in f:
        try:
          if json.loads(line)["step"] <= step:
            keep.append(line.rstrip("\n") + "\n")
        except ValueError:
          continue
    with open(self.path, "w", encoding="utf-8") as f:
      f.writelines(keep)

  def write(self, step: int, scalars: dict) -> None:
    clean = {k: float(v) for k, v in scalars.items()}
    self._file.write(json.dumps({"step": step, **clean}) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in clean.items():
        if math.isfinite(v):
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """All lines of WORKDIR/metrics.jsonl; a line that does not parse is the
  last one, cut by a kill mid-write (as MetricsWriter reads it): left out."""
  rows = []
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except ValueError:
        continue
  return rows
