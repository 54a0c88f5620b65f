"""Checks python/widen_torch.py against widen's own numbers.

    python python/test_widen_torch.py                 # the four specs, trained and dumped here
    python python/test_widen_torch.py CKPT DUMP_DIR   # one checkpoint and its `widen eval --dump`

Without arguments, for specs/residual.ron, specs/mhc.ron, specs/vwn-r4.ron and
specs/xhc.ron: `widen train SPEC --steps 3` (so the zero-initialized connection
generators are no longer zero), `widen eval final.safetensors --batches 1 --dump DIR`,
then the loader's model (float64) on the dumped batch against widen's float32 results:

- logits: max |widen - torch| <= 1e-3 (logits are O(1); f32 rounding is ~1e-6);
- loss: |widen loss_main - torch loss| <= 1e-4 * loss;
- gradients (models without MTP): per tensor, max |widen - torch| <= 2e-3 * max |widen| + 1e-7.

xHC routes each token by a top-k over f32 scores in widen and f64 scores here: a
token whose k-th and (k+1)-th scores are closer than f32 rounding (~1e-7) could be
routed differently, which shows as a logits mismatch at that token; at these sizes
that is rare, and the message names the largest difference.

The widen binary is $WIDEN, else target/debug/widen or target/release/widen in this
repository, else `widen` on PATH. Prints that it skipped (exit status 0) when numpy,
torch or the binary is missing; exit status 1 on a mismatch.
"""

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPECS = ["residual.ron", "mhc.ron", "vwn-r4.ron", "xhc.ron"]

LOGITS_ATOL = 1e-3
LOSS_RTOL = 1e-4
GRAD_RTOL = 2e-3


def skip(reason):
    print(f"skipped: {reason}")
    sys.exit(0)


try:
    import numpy as np  # noqa: F401
    import torch
except ImportError as e:
    skip(f"{e.name} is not installed (this test needs numpy and torch)")

sys.path.insert(0, HERE)
import widen_torch  # noqa: E402


def widen_binary():
    if os.environ.get("WIDEN"):
        return os.environ["WIDEN"]
    for profile in ("debug", "release"):
        path = os.path.join(ROOT, "target", profile, "widen")
        if os.path.exists(path):
            return path
    return shutil.which("widen")


def compare(ckpt, dump):
    """Failures (strings) of the loader against a checkpoint and its dump folder."""
    model = widen_torch.load(ckpt, dtype=torch.float64)
    tokens = widen_torch.read_safetensors(os.path.join(dump, "batch.safetensors"))[0]["tokens"]
    want_logits = widen_torch.read_safetensors(os.path.join(dump, "logits.safetensors"))[0]["logits"]
    losses = widen_torch.read_safetensors(os.path.join(dump, "loss.safetensors"))[0]
    tokens = torch.tensor(tokens.astype("int64"))
    failures = []

    logits = model(tokens[:, :-1])
    diff = (logits.detach() - torch.tensor(want_logits, dtype=torch.float64)).abs().max().item()
    if not diff <= LOGITS_ATOL:
        failures.append(f"logits differ by up to {diff:.3e} (tolerance {LOGITS_ATOL})")

    loss = model.loss(tokens)
    want = float(losses["loss_main"])
    if not abs(loss.item() - want) <= LOSS_RTOL * abs(want):
        failures.append(f"loss {loss.item():.6f}, widen {want:.6f}")

    if model.spec["mtp"]["depth"] == 0:
        loss.backward()
        grads = widen_torch.read_safetensors(os.path.join(dump, "grads.safetensors"))[0]
        for name, param in model.named_checkpoint_parameters():
            g = torch.tensor(grads[name], dtype=torch.float64)
            ours = param.grad if param.grad is not None else torch.zeros_like(param)
            d = (ours - g).abs().max().item()
            bound = GRAD_RTOL * g.abs().max().item() + 1e-7
            if not d <= bound:
                failures.append(f"gradient of {name} differs by {d:.3e} (bound {bound:.3e})")
    print(f"  logits max diff {diff:.2e}, loss {loss.item():.6f} vs {want:.6f}")
    return failures


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr}")


def main():
    if len(sys.argv) == 3:
        failures = compare(sys.argv[1], sys.argv[2])
        for f in failures:
            print(f"FAIL {f}")
        return 1 if failures else 0
    widen = widen_binary()
    if widen is None:
        skip("no widen binary (set WIDEN, or run `cargo build` first)")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="widen-torch-") as tmp:
        for spec in SPECS:
            name = spec[: -len(".ron")]
            out = os.path.join(tmp, name)
            print(f"{spec}:")
            run([widen, "train", os.path.join(ROOT, "specs", spec), "--steps", "3", "--out", out])
            ckpt = os.path.join(out, "final.safetensors")
            run([widen, "eval", ckpt, "--batches", "1", "--dump", os.path.join(out, "dump")])
            failures = compare(ckpt, os.path.join(out, "dump"))
            for f in failures:
                print(f"  FAIL {f}")
            failed += bool(failures)
    print("ok" if not failed else f"{failed} of {len(SPECS)} specs FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
