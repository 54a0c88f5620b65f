"""Checks that python/widen_torch.py refuses malformed and lying checkpoints.

    python3 python/test_hostile_checkpoints.py

Needs only the Python standard library: the loader checks a file with json,
struct and math before numpy or torch are imported, and these tests write the
hostile files themselves (struct + json, as the safetensors format lays them
out: an 8-byte little-endian header length, a JSON header, the tensor bytes).

Every hostile file must be refused by `check_checkpoint` and by `load` with a
CheckpointError whose message names the file and says what is wrong; a small
well-formed file must pass. With a widen binary ($WIDEN, else target/debug/widen
or target/release/widen in this repository) the checkpoints it writes with
`widen train SPEC --steps 0` for several specs must pass, and mutations of one
(a lying spec, overlapping offsets, a missing or extra tensor) must be refused;
without a binary those tests are skipped, saying so. Exit status 0 when every
test passes.
"""

import copy
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no python/__pycache__ left in the repository
import widen_torch  # noqa: E402

# ---- writing safetensors files by hand ----


def f32(values):
    return struct.pack(f"<{len(values)}f", *values)


def tensor(name, shape, dtype="F32"):
    """(name, dtype, shape, bytes) of a tensor of small distinct values."""
    count = 1
    for dim in shape:
        count *= dim
    size = widen_torch.DTYPE_BYTES[dtype]
    if dtype == "F32":
        raw = f32([((i * 7919) % 13 - 6) * 0.01 for i in range(count)])
    else:
        raw = bytes((i * 31) % 251 for i in range(count * size))
    return (name, dtype, list(shape), raw)


def encode(header, data):
    """A safetensors file of a header dict and the data section, the header padded
    with spaces to a multiple of 8 bytes as safetensors writes it."""
    text = json.dumps(header).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def layout(tensors, metadata):
    """(header dict, data bytes) of tensors laid out one after another from offset 0."""
    header = {"__metadata__": metadata}
    data = b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return header, data


def decode(blob):
    """(header dict, data bytes) of a safetensors file, read without the loader."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def tensors_of(blob):
    """[(name, dtype, shape, bytes)] of a safetensors file, in offset order, and its metadata."""
    header, data = decode(blob)
    meta = header.pop("__metadata__")
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])
    return [(n, e["dtype"], e["shape"], data[e["data_offsets"][0] : e["data_offsets"][1]]) for n, e in items], meta


# ---- a small well-formed checkpoint, written here ----

# A plain-residual model in the JSON form widen writes (`spec_json`: every field
# present, defaults filled in): D = 4, L = 1, H = 2 (head_dim 2), F = 8, V = 256.
SPEC = {
    "name": "hostile",
    "vocab": 256,
    "d_model": 4,
    "layers": 1,
    "heads": 2,
    "kv_heads": None,
    "head_dim": None,
    "ffn": {"SwiGlu": {"hidden": 8}},
    "norm_eps": 1e-05,
    "rope_base": 10000.0,
    "tie_embeddings": False,
    "init_std": 0.02,
    "out_proj_depth_scaled": True,
    "residual": "Residual",
    "mtp": {"depth": 0, "lambda": 0.3, "concat_order": "HiddenFirst"},
    "parametrization": "Standard",
    "precision": "F32",
    "train": {
        "data": {"Synthetic": "Default"},
        "seq_len": 8,
        "batch": 2,
        "steps": 10,
        "optimizer": {"AdamW": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.1}},
        "schedule": {"Cosine": {"warmup": 0, "min_ratio": 0.1}},
        "clip": 1.0,
        "seed": 0,
        "eval_every": 50,
        "eval_batches": 4,
        "val_fraction": 0.1,
        "checkpoint_every": 0,
        "keep_last": 0,
    },
}

# Its parameters as docs/checkpoints.md lists them, written out here rather than
# taken from the loader, so that the loader's implied set is checked against them.
PARAMS = [
    ("embed", [256, 4]),
    ("final_norm", [4]),
    ("unembed", [4, 256]),
    ("blocks.0.attn.norm", [4]),
    ("blocks.0.attn.wq", [4, 4]),
    ("blocks.0.attn.wk", [4, 4]),
    ("blocks.0.attn.wv", [4, 4]),
    ("blocks.0.attn.wo", [4, 4]),
    ("blocks.0.ffn.norm", [4]),
    ("blocks.0.ffn.w1", [4, 8]),
    ("blocks.0.ffn.w2", [8, 4]),
    ("blocks.0.ffn.w3", [4, 8]),
]


def metadata(spec=SPEC):
    return {
        "format": "widen-checkpoint",
        "format_version": "1",
        "spec": "Model()",
        "spec_json": json.dumps(spec),
        "step": "0",
        "data_rng": "0 0 0 0",
    }


def base_tensors():
    return [tensor(name, shape) for name, shape in PARAMS]


def well_formed():
    return encode(*layout(base_tensors(), metadata()))


def with_spec(edit):
    """The well-formed file with its spec_json edited by `edit(spec)`."""

    def make():
        spec = copy.deepcopy(SPEC)
        edit(spec)
        return encode(*layout(base_tensors(), metadata(spec)))

    return make


def with_tensors(edit):
    """The well-formed file with its tensor list edited by `edit(list)`, laid out again."""

    def make():
        tensors = base_tensors()
        edit(tensors)
        return encode(*layout(tensors, metadata()))

    return make


def with_header(edit):
    """The well-formed file with its header dict edited by `edit(header)`, the data unchanged."""

    def make():
        header, data = layout(base_tensors(), metadata())
        edit(header)
        return encode(header, data)

    return make


def connection(**fields):
    """A `Connection(...)` residual in the JSON form widen writes (mHC-lite's design,
    specs/mhc-lite.ron), with `fields` replaced."""
    sigmoid = lambda scale: {"Sigmoid": {"scale": scale, "offset": 0.0}}  # noqa: E731
    design = {
        "streams": 4,
        "segments": 1,
        "create": "Replicate",
        "collapse": "Sum",
        "generator": {"Flat": {"gain": True, "proj_init": "Zero", "gate_init": 0.01}},
        "read": {"init": {"Home": {"on": 1.0, "off": -1.0}}, "constraint": sigmoid(1.0), "form": "Matrix"},
        "carry": {"init": {"First": {"on": 0.0, "off": -8.0}}, "constraint": "Permutations", "form": "Matrix"},
        "write": {"init": {"Home": {"on": 1.0, "off": -1.0}}, "constraint": sigmoid(2.0), "form": "Matrix"},
        "out_proj_std_mult": "One",
        "history": None,
    }
    design.update(fields)
    return {"Connection": design}


def plain_connection(**fields):
    """`Connection(streams: 1)` with every other field at its default (the plain residual
    written in the language, as specs/attn-residuals.ron's fixed fields), with `fields`
    replaced."""
    plain = {
        "streams": 1,
        "generator": "None",
        "read": {"init": {"Home": {"on": 1.0, "off": 0.0}}, "constraint": "None", "form": "Matrix", "learned": True},
        "carry": {"init": "Identity", "constraint": "None", "form": "Matrix", "learned": True},
        "write": {"init": {"Constant": 1.0}, "constraint": "None", "form": "Matrix", "learned": True},
    }
    plain.update(fields)
    return connection(**plain)


def history(**fields):
    """A depth history in the JSON form widen writes (the defaults of History), with
    `fields` replaced."""
    out = {"entries": "States", "block": 2, "weights": "Attention", "dilation": 1, "period": 1}
    out.update(fields)
    return out


def set_in(path, value):
    """An edit that sets the spec field at a dotted `path` to `value`."""

    def edit(spec):
        *parents, last = path.split(".")
        obj = spec
        for key in parents:
            obj = obj[key]
        obj[last] = value

    return edit


def replace_tensor(name, new):
    def edit(tensors):
        i = next(i for i, t in enumerate(tensors) if t[0] == name)
        tensors[i] = new

    return edit


def remove_tensor(name):
    def edit(tensors):
        tensors[:] = [t for t in tensors if t[0] != name]

    return edit


def set_offsets(name, offsets):
    def edit(header):
        header[name]["data_offsets"] = offsets

    return edit


def set_entry(name, key, value):
    def edit(header):
        header[name][key] = value

    return edit


def raw_header(text, data=b""):
    """A file whose header is `text` (bytes) as given."""
    return lambda: struct.pack("<Q", len(text)) + text + data


def offsets(name):
    header, _ = layout(base_tensors(), metadata())
    return header[name]["data_offsets"]


# Each case: (test name, file maker, regular expression the error message must match).
# Messages name the field or tensor, the bad value and what would be valid.
CASES = [
    # -- the safetensors header --
    ("too_short", lambda: b"\x01\x02\x03", r"is 3 bytes long; a safetensors file starts with an 8-byte header length"),
    (
        "header_length_past_file",
        lambda: struct.pack("<Q", 5000) + b'{"__metadata__": {}}',
        r"header length 5000 .* runs past the end of the file: it is 28 bytes long, so the header can be at most 20",
    ),
    (
        "header_length_above_cap",
        lambda: struct.pack("<Q", 1 << 40) + b"{}",
        r"header length 1099511627776 .* is above the 100000000 bytes safetensors allows",
    ),
    (
        "header_not_json",
        raw_header(b"this is no JSON!"),
        r"the header is not JSON \(Expecting value at line 1 column 1\)",
    ),
    (
        "header_not_utf8",
        raw_header(b'{"a": "\xff\xfe"}    '),
        r"the 15-byte header is not UTF-8 text \(byte 7 is 0xff\)",
    ),
    (
        "header_not_object",
        raw_header(b"[1, 2, 3]       "),
        r"the header is the JSON list \[1, 2, 3\]; .* one JSON object",
    ),
    (
        "header_duplicate_key",
        raw_header(b'{"a": 1, "a": 2}'),
        r'the header has the key "a" twice; JSON object keys must be unique',
    ),
    (
        "header_huge_integer",
        raw_header(b'{"a": ' + b"9" * 5000 + b"}"),
        # Python >= 3.11 limits integer conversions; older ones read the number, which is no tensor entry.
        r"the header cannot be read as JSON \(Exceeds the limit|tensor `a` is 9{70}\.\.\.; a tensor entry is an object",
    ),
    (
        "header_deeply_nested",
        raw_header(b"[" * 100000 + b"]" * 100000),
        r"the header nests too deeply to be read",
    ),
    (
        "metadata_not_strings",
        with_header(lambda h: h["__metadata__"].update(step=0)),
        r"header `__metadata__` key `step` is 0; safetensors metadata holds strings only",
    ),
    (
        "entry_missing_key",
        with_header(lambda h: h["final_norm"].pop("shape")),
        r"tensor `final_norm` has the keys \['data_offsets', 'dtype'\] \(missing \['shape'\]",
    ),
    (
        "unknown_dtype",
        with_header(set_entry("final_norm", "dtype", "F7")),
        r'tensor `final_norm` has dtype "F7"; the safetensors dtypes are BOOL, U8, .*F32',
    ),
    (
        "negative_shape_entry",
        with_header(set_entry("blocks.0.attn.wq", "shape", [-4, -4])),
        r"tensor `blocks.0.attn.wq` has shape \[-4, -4\]: entry 0 \(-4\) must be a whole number >= 0",
    ),
    (
        "fractional_shape_entry",
        with_header(set_entry("blocks.0.attn.wq", "shape", [4, 4.0])),
        r"tensor `blocks.0.attn.wq` has shape \[4, 4.0\]: entry 1 \(4.0\) must be a whole number >= 0",
    ),
    (
        "boolean_shape_entry",
        with_header(set_entry("final_norm", "shape", [True])),
        r"tensor `final_norm` has shape \[true\]: entry 0 \(true\) must be a whole number >= 0",
    ),
    (
        "negative_offsets",
        with_header(set_offsets("embed", [-4, 4092])),
        r"tensor `embed` has data_offsets \[-4, 4092\]; they must be two whole numbers \[begin, end\] >= 0",
    ),
    (
        "offsets_reversed",
        with_header(set_offsets("final_norm", [4112, 4096])),
        r"tensor `final_norm` has data_offsets \[4112, 4096\]; begin must be <= end",
    ),
    (
        "offsets_past_end",
        with_header(set_offsets("blocks.0.ffn.w3", [o + 8 for o in offsets("blocks.0.ffn.w3")])),
        r"tensor `blocks.0.ffn.w3` has data_offsets \[\d+, \d+\], past the end of the data section: it is \d+ bytes",
    ),
    (
        "shape_bytes_mismatch",
        with_header(set_entry("final_norm", "shape", [5])),
        r"tensor `final_norm` has shape \[5\] of F32, 5 elements = 20 bytes, but its data_offsets \[4096, 4112\] "
        r"span 16 bytes",
    ),
    (
        "overlapping_offsets",
        # final_norm [4096, 4112] moved back to [4088, 4104]: it shares 8 bytes with embed's.
        with_header(set_offsets("final_norm", [4088, 4104])),
        r"tensor `final_norm` has data_offsets \[4088, 4104\], which overlap tensor `embed` at \[0, 4096\]; "
        r"each tensor's bytes must start where the previous tensor's end \(here at 4096\)",
    ),
    (
        "aliased_offsets",
        # Two tensors of the same shape reading the same bytes (the rest then also misaligns).
        with_header(set_offsets("blocks.0.attn.wk", offsets("blocks.0.attn.wq"))),
        r"tensor `blocks.0.attn.w[kq]` has data_offsets \[\d+, \d+\], which overlap tensor `blocks.0.attn.w[qk]`",
    ),
    (
        "gap_in_data",
        with_header(set_offsets("final_norm", [4100, 4116])),
        r"bytes \[4096, 4100\) of the data section belong to no tensor \(tensor `final_norm` starts at 4100",
    ),
    (
        "trailing_bytes",
        lambda: well_formed() + b"\0\0\0\0",
        r"the tensors cover bytes \[0, \d+\) of the \d+-byte data section; the 4 bytes after them belong to no tensor",
    ),
    # -- the metadata --
    (
        "not_a_widen_checkpoint",
        with_header(lambda h: h["__metadata__"].update(format="other")),
        r'not a widen checkpoint \(header `format` is "other", not "widen-checkpoint"\)',
    ),
    (
        "other_format_version",
        with_header(lambda h: h["__metadata__"].update(format_version="2")),
        r'header `format_version` is "2"; this loader reads version "1"',
    ),
    ("no_spec_json", with_header(lambda h: h["__metadata__"].pop("spec_json")), r"no `spec_json` in the header"),
    (
        "spec_json_not_json",
        with_header(lambda h: h["__metadata__"].update(spec_json="Model(layers: 2)")),
        r"header `spec_json` is not JSON",
    ),
    (
        "spec_json_nan",
        with_header(lambda h: h["__metadata__"].update(spec_json=json.dumps(SPEC).replace("10000.0", "NaN"))),
        r"header `spec_json` holds NaN, which is not JSON; numbers must be finite",
    ),
    # -- the spec's fields, within widen's ranges (ir/src/spec/limits.rs, validate.rs) --
    (
        "huge_layers",
        with_spec(set_in("layers", 1000000)),
        r"header `spec_json`: layers = 1000000 must be a whole number in 1..=1024 \(the graph unrolls every block",
    ),
    ("zero_layers", with_spec(set_in("layers", 0)), r"layers = 0 must be a whole number in 1..=1024"),
    ("fractional_layers", with_spec(set_in("layers", 1.5)), r"layers = 1.5 must be a whole number in 1..=1024"),
    ("negative_d_model", with_spec(set_in("d_model", -4)), r"d_model = -4 must be a whole number in 1..=16777216"),
    ("boolean_heads", with_spec(set_in("heads", True)), r"heads = true must be a whole number in 1..=16777216"),
    ("string_vocab", with_spec(set_in("vocab", "256")), r'vocab = "256" must be a whole number in 256..=2147483648'),
    ("small_vocab", with_spec(set_in("vocab", 100)), r"vocab = 100 must be a whole number in 256..=2147483648"),
    (
        "huge_hidden",
        with_spec(set_in("ffn.SwiGlu.hidden", 1 << 40)),
        r"ffn.hidden = 1099511627776 must be null or a whole number in 1..=16777216",
    ),
    ("rope_base_zero", with_spec(set_in("rope_base", 0)), r"rope_base = 0 must be a number > 0 and finite"),
    ("rope_base_negative", with_spec(set_in("rope_base", -1.0)), r"rope_base = -1.0 must be a number > 0 and finite"),
    ("norm_eps_zero", with_spec(set_in("norm_eps", 0.0)), r"norm_eps = 0.0 must be a number > 0 and finite"),
    (
        "kv_heads_not_dividing",
        with_spec(set_in("heads", 4)),
        r"head_dim = 1 \(d_model / heads, head_dim being null\) must be even and >= 2",
    ),
    ("kv_heads_above_heads", with_spec(set_in("kv_heads", 3)), r"kv_heads = 3 must divide heads = 2"),
    ("odd_head_dim", with_spec(set_in("head_dim", 3)), r"head_dim = 3 must be even \(RoPE rotates pairs\), or null"),
    (
        "d_model_not_divisible",
        with_spec(set_in("heads", 3)),
        r"d_model = 4 is not divisible by heads = 3 \(head_dim is null, so it is d_model / heads\)",
    ),
    ("tie_not_boolean", with_spec(set_in("tie_embeddings", 1)), r"tie_embeddings = 1 must be true or false"),
    (
        "unknown_residual",
        with_spec(set_in("residual", {"Wide": {"n": 4}})),
        r'residual = \{"Wide": \{"n": 4\}\} must be one of Residual, \{"Hc": \{...\}\}',
    ),
    ("huge_mtp_depth", with_spec(set_in("mtp.depth", 17)), r"mtp.depth = 17 must be a whole number in 0..=16"),
    ("missing_field", with_spec(lambda s: s.pop("d_model")), r"no field `d_model`"),
    ("mtp_not_object", with_spec(set_in("mtp", [1])), r"no field `mtp.depth`"),
    ("unknown_precision", with_spec(set_in("precision", "F8")), r'precision = "F8" must be one of F32, Bf16'),
    (
        "mhc_sinkhorn_iters_huge",
        with_spec(set_in("residual", {"Mhc": {"n": 4, "sinkhorn_iters": 100000, "sinkhorn_eps": 0.0, "pre_eps": 0.0,
                                               "post_max": 2.0, "collapse": "Sum"}})),  # fmt: skip
        r"residual.sinkhorn_iters = 100000 must be a whole number in 1..=1000",
    ),
    (
        "ghc_m_not_dividing",
        with_spec(set_in("residual", {"Ghc": {"m": 3, "n": 6, "dynamic": True}})),
        r"residual.m = 3 must divide d_model = 4",
    ),
    (
        "xhc_k_above_n",
        with_spec(set_in("residual", {"Xhc": {"n": 2, "k": 4, "fixed": 0}})),
        r"residual.k = 4 must be <= residual.n = 2",
    ),
    (
        "mup_base_width_above_d_model",
        with_spec(set_in("parametrization", {"MuP": {"base_width": 64, "attn_mult": 8.0, "output_mult": 1.0}})),
        r"parametrization.base_width = 64 must be in 1..=d_model \(d_model = 4\)",
    ),
    (
        "connection_huge_streams",
        with_spec(set_in("residual", connection(streams=5000))),
        r"residual.streams = 5000 must be a whole number in 1..=1024",
    ),
    (
        "connection_segments_not_dividing",
        with_spec(set_in("residual", connection(segments=3))),
        r"residual.segments = 3 must divide d_model = 4",
    ),
    (
        "connection_replicate_segments",
        with_spec(set_in("residual", connection(segments=2))),
        r'residual.create = "Replicate" copies the d_model-wide embedding into every slot, so it needs segments = 1',
    ),
    (
        "connection_concat_streams",
        with_spec(set_in("residual", connection(create="Split", segments=2, collapse="Concat"))),
        r'residual.create = "Split" cuts the embedding into segments, so it needs streams = segments \(got 4 and 2\)',
    ),
    (
        "connection_unknown_generator",
        with_spec(set_in("residual", connection(generator={"Deep": {}}))),
        r'residual.generator = \{"Deep": \{\}\} must be one of None, \{"PerSlot": \{...\}\}, \{"Flat": \{...\}\}',
    ),
    (
        "connection_permutations_of_7",
        with_spec(set_in("residual", connection(streams=7))),
        r'residual.carry.constraint = "Permutations" has streams! = 7! logits; it takes streams <= 6',
    ),
    (
        "connection_permutations_per_slot",
        with_spec(set_in("residual", connection(generator={"PerSlot": {"norm": "RmsNorm", "temperature": None,
                                                                       "act": "Tanh", "gate": "Paired",
                                                                       "gate_init": 1.0}}))),  # fmt: skip
        r'residual.carry.constraint = "Permutations" needs the s! logits of a Flat generator',
    ),
    (
        "connection_sinkhorn_read",
        with_spec(set_in("residual", connection(read={"init": "Identity", "form": "Matrix",
                                                      "constraint": {"Sinkhorn": {"iters": 5, "eps": 0.0}}}))),  # fmt: skip
        r"residual.read.constraint = .* cannot be Sinkhorn: it needs a square carry",
    ),
    (
        "connection_values_length",
        with_spec(set_in("residual", connection(read={"init": {"Values": [1.0, 2.0]}, "constraint": "None",
                                                      "form": "Matrix"}))),  # fmt: skip
        r"residual.read.init.Values = \[1.0, 2.0\] has 2 numbers; this coefficient has 4 logits",
    ),
    (
        "connection_logit_out_of_range",
        with_spec(set_in("residual", connection(write={"init": {"Logit": 1.5}, "constraint": "None",
                                                       "form": "Matrix"}))),  # fmt: skip
        r"residual.write.init.Logit = 1.5 must be in \(0, 1\)",
    ),
    (
        "connection_per_slot_write_of_4_streams_1_segment",
        with_spec(set_in("residual", connection(write={"init": {"Constant": 1.0}, "constraint": "None",
                                                       "form": "PerSlot"}))),  # fmt: skip
        r'residual.write.form = "PerSlot" sends segment i to slot i, so it needs streams = segments \(got 4 and 1\)',
    ),
    (
        "connection_lying_streams",
        with_spec(set_in("residual", connection())),
        r"tensor\(s\) the spec implies are missing: `blocks.0.attn.conn.phi` \[16, 32\], .* residual = "
        r"Connection\(streams: 4, segments: 1, generator: Flat\)",
    ),
    (
        "connection_flat_learned_disagree",
        with_spec(set_in("residual", connection(read={"init": {"Home": {"on": 1.0, "off": -1.0}}, "form": "Matrix",
                                                      "constraint": "None", "learned": False}))),  # fmt: skip
        r"residual.read.learned = false must be the learned of carry and write too: with generator: Flat one bias "
        r"holds the static parts of read, carry and write \(here read False, carry True, write True\)",
    ),
    (
        "connection_learned_not_bool",
        with_spec(set_in("residual", connection(write={"init": {"Constant": 1.0}, "constraint": "None",
                                                       "form": "Matrix", "learned": 1}))),  # fmt: skip
        r"residual.write.learned = 1 must be true or false",
    ),
    # -- the depth history (docs/math.md §12.5) --
    (
        "history_outputs_over_streams",
        with_spec(set_in("residual", connection(history=history(entries="Outputs")))),
        r"residual.streams = 4 is not allowed here: residual.history with entries: Outputs replaces the fixed state "
        r".* so it needs streams: 1; for a history beside a fixed state use entries: States",
    ),
    (
        "history_outputs_read",
        with_spec(set_in("residual", plain_connection(history=history(entries="Outputs"),
                                                      read={"init": "Identity", "constraint": "None",
                                                            "form": "Matrix"}))),  # fmt: skip
        r"residual.read = .* is not allowed here: .* so it needs read left out",
    ),
    (
        "history_outputs_dilation",
        with_spec(set_in("residual", plain_connection(history=history(entries="Outputs", dilation=2)))),
        r"residual.history.dilation = 2 must be 1: with entries: Outputs every sublayer reads every entry; dilation "
        r"and period apply to entries: States",
    ),
    (
        "history_block_above_sublayers",
        with_spec(set_in("residual", connection(history=history(block=3)))),
        r"residual.history.block = 3 must be <= 2 x layers = 2: an entry holds `block` consecutive sublayers",
    ),
    (
        "history_block_zero",
        with_spec(set_in("residual", connection(history=history(block=0)))),
        r"residual.history.block = 0 must be a whole number in 1..=2048 \(an entry holds at most every sublayer",
    ),
    (
        "history_period_fraction",
        with_spec(set_in("residual", connection(history=history(period=1.5)))),
        r"residual.history.period = 1.5 must be a whole number in 1..=2048",
    ),
    (
        "history_unknown_weights",
        with_spec(set_in("residual", connection(history=history(weights={"Static": "Last"})))),
        r'residual.history.weights = \{"Static": "Last"\} must be "Attention", \{"Static": "Newest"\}',
    ),
    (
        "history_unknown_entries",
        with_spec(set_in("residual", connection(history=history(entries="Blocks")))),
        r"residual.history.entries = \"Blocks\" must be one of Outputs, States",
    ),
    (
        "history_lying_reads",
        with_spec(set_in("residual", plain_connection(history=history(entries="Outputs", block=1)))),
        r"6 tensor\(s\) the spec implies are missing: `blocks.0.attn.history.query` \[4\], .* residual = "
        r"Connection\(streams: 1, segments: 1, generator: None, history: History\(entries: Outputs, block: 1",
    ),
    # -- the tensors against the parameters the spec implies --
    (
        "lying_layers",
        with_spec(set_in("layers", 3)),
        r"18 tensor\(s\) the spec implies are missing: `blocks.1.attn.norm` \[4\], .* and 14 more; the spec says "
        r"vocab = 256, d_model = 4, layers = 3",
    ),
    (
        "missing_tensor",
        with_tensors(remove_tensor("blocks.0.ffn.w2")),
        r"1 tensor\(s\) the spec implies are missing: `blocks.0.ffn.w2` \[8, 4\]; the spec says",
    ),
    (
        "extra_tensor",
        with_tensors(lambda ts: ts.append(tensor("blocks.1.attn.norm", [4]))),
        r"1 tensor\(s\) are no parameter of the model the spec describes: `blocks.1.attn.norm` \[4\]; the spec says "
        r".*layers = 1",
    ),
    (
        "wrong_shape",
        with_tensors(replace_tensor("blocks.0.attn.wq", tensor("blocks.0.attn.wq", [2, 8]))),
        r"tensor `blocks.0.attn.wq` has shape \[2, 8\]; the spec implies \[4, 4\] \(the spec says .*heads = 2, "
        r"kv_heads = 2, head_dim = 2",
    ),
    (
        "tied_spec_with_unembed",
        with_spec(set_in("tie_embeddings", True)),
        r"1 tensor\(s\) are no parameter of the model the spec describes: `unembed` \[4, 256\]",
    ),
    (
        "wrong_dtype",
        with_tensors(replace_tensor("final_norm", tensor("final_norm", [4], "F64"))),
        r"tensor `final_norm` has dtype F64; widen checkpoints hold F32 tensors",
    ),
    (
        "optimizer_state_of_nothing",
        with_tensors(lambda ts: ts.append(tensor("opt.blocks.0.attn.wz.m", [4, 4]))),
        r"tensor `opt.blocks.0.attn.wz.m` is no optimizer state of this model",
    ),
    (
        "optimizer_state_wrong_shape",
        with_tensors(lambda ts: ts.append(tensor("opt.final_norm.v", [5]))),
        r"tensor `opt.final_norm.v` has shape \[5\]; as state of `final_norm` it must have its shape \[4\]",
    ),
]

# Cases whose spec is valid but names a configuration the loader does not build.
UNSUPPORTED = [
    ("bf16", with_spec(set_in("precision", "Bf16")), r"precision Bf16: only F32 is built"),
]


class Hostile(unittest.TestCase):
    """Every case of CASES is refused, by check_checkpoint and by load, before anything is built."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="widen-hostile-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def write(self, name, blob):
        path = os.path.join(self.tmp, f"{name}.safetensors")
        with open(path, "wb") as f:
            f.write(blob)
        return path

    def refused(self, name, make, pattern):
        path = self.write(name, make())
        with self.assertRaisesRegex(widen_torch.CheckpointError, pattern) as caught:
            widen_torch.check_checkpoint(path)
        message = str(caught.exception)
        self.assertTrue(message.startswith(path + ": "), f"the message names the file: {message}")
        # load() checks the same way before it decodes a tensor or imports torch.
        with self.assertRaisesRegex(widen_torch.CheckpointError, pattern):
            widen_torch.load(path)

    def test_well_formed_passes(self):
        path = self.write("well_formed", well_formed())
        spec, sizes, entries, _ = widen_torch.check_checkpoint(path)
        self.assertEqual(spec, SPEC)
        self.assertEqual(widen_torch.expected_parameters(spec), dict(PARAMS))
        self.assertEqual({n: list(e.shape) for n, e in entries.items()}, dict(PARAMS))
        self.assertEqual((sizes.head_dim, sizes.kv_heads, sizes.hidden), (2, 2, 8))

    def test_default_widths_resolve(self):
        spec = copy.deepcopy(SPEC)
        spec["ffn"]["SwiGlu"]["hidden"] = None
        spec["d_model"], spec["heads"] = 96, 4
        sizes = widen_torch.check_spec(spec)
        # FfnSpec::default_hidden(96) = round_up(ceil(8 * 96 / 3), 256) = 256; head_dim = 96 / 4.
        self.assertEqual((sizes.hidden, sizes.head_dim), (256, 24))

    def test_check_needs_no_numpy_or_torch(self):
        path = self.write("well_formed_subprocess", well_formed())
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); import widen_torch; "
            "widen_torch.check_checkpoint(sys.argv[2]); "
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))"
        )
        out = subprocess.run([sys.executable, "-B", "-c", code, HERE, path], capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.strip(), "[]")

    @unittest.skipUnless(importlib.util.find_spec("numpy"), "numpy is not installed (tensors are decoded with it)")
    def test_non_finite_weight_is_refused_when_decoded(self):
        # Its header, spec and shapes are fine; the values are what is wrong.
        bad = ("blocks.0.attn.wo", "F32", [4, 4], f32([0.0] * 5 + [float("nan")] + [0.0] * 10))
        path = self.write("non_finite", with_tensors(replace_tensor("blocks.0.attn.wo", bad))())
        widen_torch.check_checkpoint(path)
        pattern = r"tensor `blocks.0.attn.wo` holds a non-finite value \(nan\)"
        with self.assertRaisesRegex(widen_torch.CheckpointError, pattern):
            widen_torch.read_checkpoint(path)
        self.assertEqual(len(widen_torch.read_checkpoint(self.write("finite", well_formed()))[1]), len(PARAMS))

    def accepted(self, name, residual, extra):
        """A file of the plain model's tensors and `extra`, its residual `residual`, passes
        check_checkpoint and implies exactly those tensors."""
        spec = copy.deepcopy(SPEC)
        spec["residual"] = residual
        params = PARAMS + extra
        blob = encode(*layout([tensor(n, shape) for n, shape in params], metadata(spec)))
        path = self.write(name, blob)
        _, sizes, entries, _ = widen_torch.check_checkpoint(path)
        self.assertEqual(widen_torch.expected_parameters(spec), dict(params))
        self.assertEqual({n: list(e.shape) for n, e in entries.items()}, dict(params))
        return sizes

    def test_history_of_outputs_passes(self):
        # Full attention residuals with static mean weights (docs/math.md §12.5), L = 1: the
        # attention reads the embedding, the FFN it and the attention's output, the head
        # all three; no sublayer has a read, carry or write of its own.
        residual = plain_connection(history=history(entries="Outputs", block=1, weights={"Static": "Mean"}))
        extra = [
            ("blocks.0.attn.history.weights", [1]),
            ("blocks.0.ffn.history.weights", [2]),
            ("history.weights", [3]),
        ]
        sizes = self.accepted("history_outputs", residual, extra)
        self.assertEqual(widen_torch.constant_parameters(sizes), set())

    def test_history_of_states_passes(self):
        # A history of states after every sublayer with dilation 2 over the plain one-slot
        # state, its carry a constant: entry 1 (after the attention) reads entry 1 alone,
        # entry 2 (after the FFN) entries 0 and 2; attention weights, W = 4.
        carry = {"init": "Identity", "constraint": "None", "form": "Matrix", "learned": False}
        residual = plain_connection(carry=carry, history=history(block=1, dilation=2))
        extra = [(f"blocks.0.{k}.conn.{r}", [1, 1]) for k in ("attn", "ffn") for r in ("h_pre", "h_res", "h_post")]
        extra += [(f"blocks.0.{k}.history.{r}", [4]) for k in ("attn", "ffn") for r in ("query", "norm")]
        sizes = self.accepted("history_states", residual, extra)
        constants = widen_torch.constant_parameters(sizes)
        self.assertEqual(constants, {"blocks.0.attn.conn.h_res", "blocks.0.ffn.conn.h_res"})
        reads = sizes.design.history.reads(4)
        self.assertEqual(reads, [(0, [1]), (1, [0, 2]), (2, [1, 3]), (3, [0, 2, 4])])
        # Static weights: one per entry read, oldest first; a period of 2 skips the odd entries.
        odd = widen_torch.DepthHistory("States", 1, "Ones", True, 1, 2)
        self.assertEqual(odd.reads(4), [(1, [0, 1, 2]), (3, [0, 1, 2, 3, 4])])

    def test_unsupported_configurations(self):
        for name, make, pattern in UNSUPPORTED:
            with self.subTest(name):
                path = self.write(name, make())
                with self.assertRaisesRegex(NotImplementedError, pattern):
                    widen_torch.check_checkpoint(path)


def _add_case(name, make, pattern):
    setattr(Hostile, f"test_{name}", lambda self: self.refused(name, make, pattern))


for _case in CASES:
    _add_case(*_case)

# ---- checkpoints written by widen ----


def widen_binary():
    if os.environ.get("WIDEN"):
        return os.environ["WIDEN"]
    for profile in ("debug", "release"):
        path = os.path.join(ROOT, "target", profile, "widen")
        if os.path.exists(path):
            return path
    return shutil.which("widen")


# Specs whose initial checkpoints (`widen train SPEC --steps 0`) the loader must accept:
# the schemes it builds, tiny.ron (GHC, r = 2) and mtp.ron (GHC with an MTP module).
REAL_SPECS = [
    "tiny.ron", "residual.ron", "mhc.ron", "vwn-r4.ron", "xhc.ron", "mtp.ron",
    "hc.ron", "fc.ron", "mhc-lite.ron", "wide-residual.ron", "attn-residuals.ron", "denseformer.ron", "kromhc.ron",
]  # fmt: skip

# More configurations, one branch of the implied parameter set each: GQA with an
# explicit head_dim, tied embeddings and two MTP modules; mHC with MTP; static GHC
# with embed_mode Expand and n not a multiple of m (no GroupNorm); GHC with
# reduce_norm Off, muP and Muon (momentum state); xHC with fixed = k (no router),
# convolutions on the attention too, and MTP; xHC without convolutions; depth histories
# (docs/math.md §12.5) with MTP modules, which start histories of their own: of outputs
# in the full form, and with blocks of 3 (across the trunk's blocks; the module's two
# sublayers finish no entry); of states over a Flat state whose static parts are
# constants, with dilation and period 2, and over a GHC-like Reduce state.
_TRAIN = "train: (seq_len: 16, batch: 2, steps: 100)"
_MUON = "train: (seq_len: 16, batch: 2, steps: 100, optimizer: Muon())"
VARIANT_SPECS = {
    "gqa-tied-mtp2": f"d_model: 32, layers: 2, heads: 4, kv_heads: 2, head_dim: 8, tie_embeddings: true, "
    f"mtp: (depth: 2), {_TRAIN}",
    "mhc-mean-mtp": f"d_model: 32, layers: 1, heads: 4, residual: Mhc(n: 3, collapse: Mean), mtp: (depth: 1), {_TRAIN}",
    "ghc-static-expand": f"d_model: 32, layers: 1, heads: 4, residual: Ghc(m: 4, n: 6, dynamic: false, "
    f"embed_mode: Expand), mtp: (depth: 1), {_TRAIN}",
    "ghc-off-mup-muon": f"d_model: 32, layers: 1, heads: 4, residual: Ghc(m: 2, n: 8, reduce_norm: Off), "
    f"parametrization: MuP(base_width: 16), {_MUON}",
    "xhc-fixed-attn-conv": f"d_model: 32, layers: 1, heads: 4, residual: Xhc(n: 6, k: 3, fixed: 3, conv_kernels: [3], "
    f"temporal_aug: MlpAndAttention), mtp: (depth: 1), {_MUON}",
    "xhc-no-conv": f"d_model: 32, layers: 1, heads: 4, ffn: SwiGlu(hidden: 40), residual: Xhc(n: 4, k: 2, fixed: 1, "
    f"conv_kernels: []), {_TRAIN}",
    "hc-static-mtp": f"d_model: 32, layers: 1, heads: 4, residual: Hc(n: 3, dynamic: false), mtp: (depth: 1), {_TRAIN}",
    "fc-rms-mtp-muon": f"d_model: 32, layers: 1, heads: 4, residual: Fc(m: 2), mtp: (depth: 1), {_MUON}",
    "conn-perslot-expand-mtp": f"d_model: 32, layers: 1, heads: 4, residual: Connection(streams: 4, segments: 2, "
    f"create: Wide(Expand), collapse: Reduce(norm: GroupNorm, init: Normal), generator: PerSlot(norm: LayerNorm, "
    f"gate: Paired), read: (init: Identity), carry: (init: Logit(0.9), constraint: Sigmoid(scale: 1.0, offset: 0.0), "
    f"form: PerSlot), write: (init: Cyclic)), mtp: (depth: 1), {_TRAIN}",
    "conn-flat-perms-readout-tied-mtp": f"d_model: 32, layers: 1, heads: 4, tie_embeddings: true, "
    f"residual: Connection(streams: 3, collapse: Readout(init: Constant(0.0), constraint: Softmax), "
    f"generator: Flat(gain: false), carry: (init: First(on: 1.0, off: 0.0), constraint: Permutations)), "
    f"mtp: (depth: 2), {_TRAIN}",
    "conn-static-wide-full-entrywise": f"d_model: 32, layers: 1, heads: 4, residual: Connection(streams: 4, "
    f"segments: 2, create: Wide(Full), collapse: Reduce(norm: Off, init: BlockIdentity), generator: PerSlot(gate: "
    f"Entrywise), read: (init: Identity), write: (init: Cyclic)), {_TRAIN}",
    "hist-outputs-full-mtp2": f"d_model: 32, layers: 2, heads: 4, residual: Connection(streams: 1, "
    f"history: History(entries: Outputs, block: 1)), mtp: (depth: 2), {_TRAIN}",
    "hist-outputs-block3-static": f"d_model: 32, layers: 2, heads: 4, residual: Connection(streams: 1, "
    f"history: History(entries: Outputs, block: 3, weights: Static(Ones))), mtp: (depth: 1), {_TRAIN}",
    "hist-states-flat-fixed-mtp": f"d_model: 32, layers: 2, heads: 4, residual: Connection(streams: 2, "
    f"generator: Flat(), read: (init: Home(on: 1.0, off: 0.0), learned: false), "
    f"carry: (init: Identity, learned: false), "
    f"write: (init: Constant(1.0), learned: false), history: History(entries: States, block: 1, "
    f"weights: Static(Mean), dilation: 2, period: 2)), mtp: (depth: 1), {_TRAIN}",
    "hist-states-reduce-mtp": f"d_model: 32, layers: 1, heads: 4, residual: Connection(streams: 4, segments: 2, "
    f"create: Wide(Expand), collapse: Reduce(norm: GroupNorm, init: Normal), generator: PerSlot(), "
    f"read: (init: Identity), write: (init: Cyclic), history: History(entries: States, block: 2)), "
    f"mtp: (depth: 1), {_TRAIN}",
}


class WidenCheckpoints(unittest.TestCase):
    """Checkpoints widen writes pass; one (tiny.ron's) mutated is refused."""

    @classmethod
    def setUpClass(cls):
        cls.widen = widen_binary()
        if cls.widen is None:
            raise unittest.SkipTest("no widen binary (set WIDEN, or run `cargo build` first)")
        cls.tmp = tempfile.mkdtemp(prefix="widen-hostile-real-")
        cls.ckpt = {}
        specs = [os.path.join(ROOT, "specs", spec) for spec in REAL_SPECS]
        for name, fields in VARIANT_SPECS.items():
            specs.append(os.path.join(cls.tmp, f"{name}.ron"))
            with open(specs[-1], "w") as f:
                f.write(f'Model(name: "{name}", {fields})\n')
        for spec_path in specs:
            spec = os.path.basename(spec_path)
            out = os.path.join(cls.tmp, spec[: -len(".ron")])
            cmd = [cls.widen, "train", spec_path, "--steps", "0", "--out", out]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr}")
            cls.ckpt[spec] = os.path.join(out, "init.safetensors")
        with open(cls.ckpt["tiny.ron"], "rb") as f:
            cls.tiny = f.read()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_widen_checkpoints_pass(self):
        for spec, path in self.ckpt.items():
            with self.subTest(spec):
                _, _, entries, meta = widen_torch.check_checkpoint(path)
                params = {n for n in entries if not n.startswith("opt.")}
                self.assertEqual(params, set(widen_torch.expected_parameters(json.loads(meta["spec_json"]))))
                # Training checkpoints carry optimizer state, which is checked too.
                self.assertTrue(any(n.startswith("opt.") for n in entries))
        self.assertEqual(len(self.ckpt), len(REAL_SPECS) + len(VARIANT_SPECS))

    def mutated(self, name, blob, pattern):
        path = os.path.join(self.tmp, f"{name}.safetensors")
        with open(path, "wb") as f:
            f.write(blob)
        with self.assertRaisesRegex(widen_torch.CheckpointError, pattern):
            widen_torch.check_checkpoint(path)
        with self.assertRaisesRegex(widen_torch.CheckpointError, pattern):
            widen_torch.load(path)

    def spec_edit(self, edit):
        tensors, meta = tensors_of(self.tiny)
        spec = json.loads(meta["spec_json"])
        edit(spec)
        meta["spec_json"] = json.dumps(spec)
        return encode(*layout(tensors, meta))

    def test_widen_unmodified_copy_passes(self):
        # The re-encoding the mutations use keeps a file valid by itself.
        path = os.path.join(self.tmp, "reencoded.safetensors")
        with open(path, "wb") as f:
            f.write(encode(*layout(*tensors_of(self.tiny))))
        widen_torch.check_checkpoint(path)

    def test_widen_huge_layers(self):
        # The observed case: a 1.9 MB file whose spec says a million blocks.
        self.mutated("real_huge_layers", self.spec_edit(set_in("layers", 1000000)), r"layers = 1000000 must be")

    def test_widen_lying_layers(self):
        blob = self.spec_edit(set_in("layers", 3))
        pattern = r"tensor\(s\) the spec implies are missing: `blocks.2.attn.norm` \[64\]"
        self.mutated("real_lying_layers", blob, pattern)

    def test_widen_rope_base_zero(self):
        blob = self.spec_edit(set_in("rope_base", 0.0))
        self.mutated("real_rope_zero", blob, r"rope_base = 0.0 must be a number > 0")

    def test_widen_lying_stream_count(self):
        blob = self.spec_edit(lambda s: s["residual"]["Ghc"].update(n=8))
        pattern = r"tensor `[^`]+` has shape \[[0-9, ]+\]; the spec implies .*residual = Ghc\(m: 2, n: 8"
        self.mutated("real_lying_n", blob, pattern)

    def test_widen_overlapping_offsets(self):
        header, data = decode(self.tiny)
        name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin - 4, end - 4]
        pattern = rf"tensor `{name}` has data_offsets \[{begin - 4}, {end - 4}\], which overlap"
        self.mutated("real_overlap", encode(header, data), pattern)

    def test_widen_missing_tensor(self):
        tensors, meta = tensors_of(self.tiny)
        kept = [t for t in tensors if t[0] not in ("reduce.w", "opt.reduce.w.m", "opt.reduce.w.v")]
        self.mutated("real_missing", encode(*layout(kept, meta)), r"missing: `reduce.w` \[128, 64\]")

    def wrong_table(self, spec, table, pattern):
        """`spec`'s checkpoint with the first two rows of its constant `table` swapped: a
        well-formed file whose carry would mix other matrices than widen's. It passes the
        file checks, is refused when a model is built, and the unmodified file builds."""
        with open(self.ckpt[spec], "rb") as f:
            tensors, meta = tensors_of(f.read())
        at = next(k for k, t in enumerate(tensors) if t[0] == table)
        name, dtype, shape, raw = tensors[at]
        row = shape[1] * 4
        tensors[at] = (name, dtype, shape, raw[row : 2 * row] + raw[:row] + raw[2 * row :])
        path = os.path.join(self.tmp, f"real_wrong_{table}.safetensors")
        with open(path, "wb") as f:
            f.write(encode(*layout(tensors, meta)))
        widen_torch.check_checkpoint(path)
        with self.assertRaisesRegex(widen_torch.CheckpointError, pattern):
            widen_torch.load(path)
        widen_torch.load(self.ckpt[spec])

    @unittest.skipUnless(
        importlib.util.find_spec("numpy") and importlib.util.find_spec("torch"),
        "numpy or torch is not installed (the table's values are checked when a model is built)",
    )
    def test_widen_wrong_permutation_table(self):
        # mHC-lite's table with its first two permutation matrices swapped.
        pattern = r"tensor `conn.permutations` is not the table of the 24 permutation matrices of 4 streams"
        self.wrong_table("mhc-lite.ron", "conn.permutations", pattern)

    @unittest.skipUnless(
        importlib.util.find_spec("numpy") and importlib.util.find_spec("torch"),
        "numpy or torch is not installed (the table's values are checked when a model is built)",
    )
    def test_widen_wrong_kronecker_table(self):
        # KromHC's factor table with factor 0's rows (where p goes, where 1 - p goes) swapped.
        pattern = r"tensor `conn.kronecker` is not the factor table of a Kronecker carry over 4 streams"
        self.wrong_table("kromhc.ron", "conn.kronecker", pattern)

    def test_widen_extra_tensor(self):
        tensors, meta = tensors_of(self.tiny)
        tensors.append(tensor("blocks.2.attn.norm", [64]))
        pattern = r"no parameter of the model .*: `blocks.2.attn.norm` \[64\]"
        self.mutated("real_extra", encode(*layout(tensors, meta)), pattern)


if __name__ == "__main__":
    unittest.main()
