"""Checks python/widen_torch.py against widen's own numbers.

    python python/test_widen_torch.py                 # the specs below, trained and dumped here
    python python/test_widen_torch.py CKPT DUMP_DIR   # one checkpoint and its `widen eval --dump`

Without arguments, for each of SPECS (in specs/) and VARIANT_SPECS (connection
designs written here, one branch of the loader each): `widen train SPEC --steps 3`
(so the zero-initialized connection generators are no longer zero),
`widen eval final.safetensors --batches 1 --dump DIR`, then the loader's model
(float64) on the dumped batch against widen's float32 results:

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
SPECS = [
    "residual.ron", "mhc.ron", "vwn-r4.ron", "xhc.ron",
    "hc.ron", "fc.ron", "mhc-lite.ron", "wide-residual.ron",
    "attn-residuals.ron", "denseformer.ron", "kromhc.ron",
]  # fmt: skip

# Designs of the connection language beyond specs/, one branch of the loader each: a
# PerSlot generator with LayerNorm, no activation and the Paired gate under muP, over a
# Wide(Expand) state of 4 slots of D/2, with a Softmax read, a per-slot retention carry,
# a Tanh write and the GroupNorm reduce; a Flat generator without gain, a Tanh read, a
# Sinkhorn carry and a Softmax readout with a tied head; a static Split / Concat design
# with a Permutations carry and a per-segment write; an Entrywise PerSlot generator
# with a set temperature, a Softmax carry and a tied Wide(Full) embedding; HC with
# RmsNorm and no activation; static FC. Depth histories (docs/math.md §12.5): of
# states over a 2-stream Flat fixed state under muP, with attention weights and
# dilation 2; of outputs with Static(Mean) weights and block 1 (the full form); of
# states over a PerSlot Split / Concat state whose carry and write are constants
# (`learned: false`), static Newest weights and period 2; of outputs in blocks of 3
# with an MTP module (the main head's logits and loss only).
_BASE = "d_model: 32, layers: 2, heads: 4, train: (seq_len: 16, batch: 4, steps: 100)"
VARIANT_SPECS = {
    "conn-perslot-wide": "parametrization: MuP(base_width: 16), residual: Connection(streams: 4, segments: 2, "
    "create: Wide(Expand), collapse: Reduce(norm: GroupNorm, init: Normal), "
    "generator: PerSlot(norm: LayerNorm, act: Identity, gate: Paired, gate_init: 0.5), "
    "read: (init: Constant(0.5), constraint: Softmax), "
    "carry: (init: Logit(0.9), constraint: Sigmoid(scale: 1.0, offset: 0.0), form: PerSlot), "
    "write: (init: Cyclic, constraint: Tanh))",
    "conn-flat-sinkhorn": "tie_embeddings: true, residual: Connection(streams: 3, create: Replicate, "
    "collapse: Readout(init: Constant(0.0), constraint: Softmax), "
    "generator: Flat(gain: false, proj_init: Xavier, gate_init: 0.1), "
    "read: (init: Home(on: 1.0, off: 0.0), constraint: Tanh), "
    "carry: (init: Eye(on: 2.0, off: -2.0), constraint: Sinkhorn(iters: 10, eps: 1e-6)), "
    "write: (init: Linspace(0.5, 1.5)))",
    "conn-split-perms": "residual: Connection(streams: 4, segments: 4, create: Split, collapse: Concat, "
    "generator: None, read: (init: Identity, constraint: Softmax), "
    "carry: (init: First(on: 2.0, off: 0.0), constraint: Permutations), "
    "write: (init: Constant(1.0), constraint: Sigmoid(scale: 2.0, offset: 0.0), form: PerSlot))",
    "conn-wide-tied": "tie_embeddings: true, residual: Connection(streams: 2, segments: 2, create: Wide(Full), "
    "collapse: Concat, generator: PerSlot(temperature: Some(2.0), gate: Entrywise, gate_init: 0.3), "
    "read: (init: Identity), carry: (init: Eye(on: 0.9, off: 0.05), constraint: Softmax), "
    "write: (init: Values([1.0, 0.1, 0.2, 0.8])))",
    "hc-rms-identity": "residual: Hc(n: 3, gen_norm: RmsNorm, act: Identity, scale_init: 0.1)",
    "fc-static": "residual: Fc(m: 2, dynamic: false)",
    "hist-states-flat-attn": "parametrization: MuP(base_width: 16), residual: Connection(streams: 2, "
    "generator: Flat(gain: true, proj_init: Xavier), "
    "read: (init: Home(on: 1.0, off: -1.0), constraint: Sigmoid(scale: 1.0, offset: 0.0)), "
    "carry: (init: Eye(on: 2.0, off: -2.0), constraint: Softmax), "
    "write: (init: Constant(0.0), constraint: Sigmoid(scale: 2.0, offset: 0.0)), "
    "history: History(entries: States, block: 1, weights: Attention, dilation: 2))",
    "hist-outputs-mean": "residual: Connection(streams: 1, "
    "history: History(entries: Outputs, block: 1, weights: Static(Mean)))",
    "hist-states-perslot-fixed": "residual: Connection(streams: 2, segments: 2, create: Split, collapse: Concat, "
    "generator: PerSlot(gate: Paired, gate_init: 0.5), read: (init: Identity), "
    "carry: (init: Identity, learned: false), write: (init: Constant(1.0), form: PerSlot, learned: false), "
    "history: History(entries: States, block: 1, weights: Static(Newest), period: 2))",
    "hist-outputs-mtp": "mtp: (depth: 1), residual: Connection(streams: 1, history: History(block: 3))",
}

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

    worst = None  # (max |widen - torch| / its bound, name) over the gradients
    if model.spec["mtp"]["depth"] == 0:
        loss.backward()
        grads = widen_torch.read_safetensors(os.path.join(dump, "grads.safetensors"))[0]
        for name, param in model.named_checkpoint_parameters():
            g = torch.tensor(grads[name], dtype=torch.float64)
            ours = param.grad if param.grad is not None else torch.zeros_like(param)
            d = (ours - g).abs().max().item()
            bound = GRAD_RTOL * g.abs().max().item() + 1e-7
            worst = max(worst or (d / bound, name), (d / bound, name))
            if not d <= bound:
                failures.append(f"gradient of {name} differs by {d:.3e} (bound {bound:.3e})")
    grads = f", gradient differences at most {worst[0]:.1e} x their bound ({worst[1]})" if worst else ""
    print(f"  logits max diff {diff:.2e}, loss {loss.item():.6f} vs {want:.6f}{grads}")
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
        specs = [os.path.join(ROOT, "specs", spec) for spec in SPECS]
        for name, fields in VARIANT_SPECS.items():
            specs.append(os.path.join(tmp, f"{name}.ron"))
            with open(specs[-1], "w") as f:
                f.write(f'Model(name: "{name}", {_BASE}, {fields})\n')
        for path in specs:
            spec = os.path.basename(path)
            name = spec[: -len(".ron")]
            out = os.path.join(tmp, name)
            print(f"{spec}:")
            run([widen, "train", path, "--steps", "3", "--out", out])
            ckpt = os.path.join(out, "final.safetensors")
            run([widen, "eval", ckpt, "--batches", "1", "--dump", os.path.join(out, "dump")])
            failures = compare(ckpt, os.path.join(out, "dump"))
            for f in failures:
                print(f"  FAIL {f}")
            failed += bool(failures)
    print("ok" if not failed else f"{failed} of {len(specs)} specs FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
