"""Load a widen checkpoint into PyTorch and compute its logits and loss.

Needs only numpy and torch (no widen install). A checkpoint is a safetensors
file; this module parses its header (8-byte little-endian length, then JSON)
and the raw little-endian bytes itself. The file format, every tensor's name,
shape and orientation are documented in docs/checkpoints.md; the equations are
those of docs/math.md, implemented as widen's lowering implements them
(ir/src/lower/).

Supported: the plain residual; every design of the connection language
(`residual: Connection(...)`, docs/connections.md, docs/math.md §12: any
create, collapse, generator, constraint and form, static parts trained or
constant with `learned: false`, and a depth `history` of outputs or states,
§12.5, as ir/src/lower/schemes/history.rs lowers it) and HC (§2), FC (§3),
mHC (§4) and GHC / VWN (§5), which are its spellings and are built by the same
code, as widen lowers them (ir/src/lower/schemes/connection.rs); and full xHC
(§6, flash: None); with a SwiGLU FFN, f32 precision, the standard
parametrization or muP (§8.1), tied or separate unembedding. With MTP modules
(§7) the main head's logits and next-token loss are computed; the MTP terms
are not. Other configurations (MoE, xHC-Flash, bf16) raise NotImplementedError.

    import widen_torch
    model = widen_torch.load("runs/vwn-r4/final.safetensors")
    logits = model(tokens[:, :-1])              # [B, T, 256]
    loss = model.loss(tokens)                   # tokens: [B, T + 1] windows

A file is checked whole before anything is built from it (`check_checkpoint`,
which needs only the standard library: numpy and torch are imported when a
model is built): the safetensors header as the format requires it, the embedded
spec's fields within the ranges widen's own validation applies
(ir/src/spec/limits.rs, ir/src/spec/validate.rs), and the tensors against the
parameter set that spec implies, name by name and shape by shape. A file that
fails raises CheckpointError naming the file, the field or tensor, the bad
value and what would be valid; a spec that lied about its sizes could
otherwise make the loader allocate without bound or compute NaN silently
(docs/checkpoints.md, "Reading a checkpoint from Python").

The names every scheme reads are in TENSOR_NAMES below, one literal that a
widen test (tests/checkpoint_names.rs) checks against the names widen writes
for specs/residual.ron, specs/mhc.ron, specs/vwn-r4.ron and specs/xhc.ron;
python/test_hostile_checkpoints.py checks the whole parameter set the loader
implies against the checkpoints widen writes for more specs, the connection
designs among them.
"""

import importlib
import itertools
import json
import math
import os
import struct


class _LazyModule:
    """A module imported on its first attribute access, so that reading and checking
    a checkpoint needs only the standard library (numpy and torch are imported when
    tensors are decoded or a model is built)."""

    def __init__(self, name):
        self._name = name
        self._module = None

    def __getattr__(self, attr):
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


np = _LazyModule("numpy")
torch = _LazyModule("torch")
F = _LazyModule("torch.nn.functional")


class CheckpointError(ValueError):
    """A file that is not a well-formed widen checkpoint, or whose spec does not
    describe its tensors. The message names the file, the header field or tensor,
    the bad value and what would be valid."""


# The tensor names each scheme's model reads, as templates: `{i}` is a block
# index (0..layers-1), `{j}` an xHC convolution index (0..len(conv_kernels)-1).
# Keys name the roles used below. The literal between the BEGIN and END lines is
# JSON (double quotes, no trailing commas) so that the Rust test can parse it.
# The lists are those of the configurations in specs/*.ron; optional names (a
# static GHC has no generator, a tied head no `unembed`, ...) are listed and
# skipped by the loader where the spec says they are absent.
# HC, FC, mHC, GHC and `Connection(...)` are one design language with one set of
# names (ir/src/lower/schemes/connection.rs): a Flat generator's are in "mhc",
# the static parts', a PerSlot generator's, the wide embedding's and the reduce's
# in "ghc" (specs/mhc.ron and specs/vwn-r4.ron write exactly those lists), and
# the names only other designs have in "connection".
# BEGIN TENSOR_NAMES
TENSOR_NAMES = {
    "backbone": {
        "embed": "embed",
        "final_norm": "final_norm",
        "unembed": "unembed",
        "attn.norm": "blocks.{i}.attn.norm",
        "attn.wq": "blocks.{i}.attn.wq",
        "attn.wk": "blocks.{i}.attn.wk",
        "attn.wv": "blocks.{i}.attn.wv",
        "attn.wo": "blocks.{i}.attn.wo",
        "ffn.norm": "blocks.{i}.ffn.norm",
        "ffn.w1": "blocks.{i}.ffn.w1",
        "ffn.w2": "blocks.{i}.ffn.w2",
        "ffn.w3": "blocks.{i}.ffn.w3"
    },
    "residual": {},
    "mhc": {
        "attn.phi": "blocks.{i}.attn.conn.phi",
        "attn.alpha": "blocks.{i}.attn.conn.alpha",
        "attn.bias": "blocks.{i}.attn.conn.bias",
        "ffn.phi": "blocks.{i}.ffn.conn.phi",
        "ffn.alpha": "blocks.{i}.ffn.conn.alpha",
        "ffn.bias": "blocks.{i}.ffn.conn.bias"
    },
    "ghc": {
        "embed_wide": "embed_wide",
        "attn.h_pre": "blocks.{i}.attn.conn.h_pre",
        "attn.h_res": "blocks.{i}.attn.conn.h_res",
        "attn.h_post": "blocks.{i}.attn.conn.h_post",
        "attn.norm": "blocks.{i}.attn.conn.norm",
        "attn.w_alpha": "blocks.{i}.attn.conn.w_alpha",
        "attn.w_beta": "blocks.{i}.attn.conn.w_beta",
        "attn.s_pre": "blocks.{i}.attn.conn.s_pre",
        "attn.s_res": "blocks.{i}.attn.conn.s_res",
        "attn.s_post": "blocks.{i}.attn.conn.s_post",
        "ffn.h_pre": "blocks.{i}.ffn.conn.h_pre",
        "ffn.h_res": "blocks.{i}.ffn.conn.h_res",
        "ffn.h_post": "blocks.{i}.ffn.conn.h_post",
        "ffn.norm": "blocks.{i}.ffn.conn.norm",
        "ffn.w_alpha": "blocks.{i}.ffn.conn.w_alpha",
        "ffn.w_beta": "blocks.{i}.ffn.conn.w_beta",
        "ffn.s_pre": "blocks.{i}.ffn.conn.s_pre",
        "ffn.s_res": "blocks.{i}.ffn.conn.s_res",
        "ffn.s_post": "blocks.{i}.ffn.conn.s_post",
        "reduce.norm": "reduce.norm",
        "reduce.norm_bias": "reduce.norm_bias",
        "reduce.w": "reduce.w"
    },
    "xhc": {
        "attn.router": "blocks.{i}.attn.conn.router",
        "attn.pre": "blocks.{i}.attn.conn.pre",
        "attn.b_pre": "blocks.{i}.attn.conn.b_pre",
        "attn.alpha_pre": "blocks.{i}.attn.conn.alpha_pre",
        "attn.res": "blocks.{i}.attn.conn.res",
        "attn.b_res": "blocks.{i}.attn.conn.b_res",
        "attn.alpha_res": "blocks.{i}.attn.conn.alpha_res",
        "attn.post": "blocks.{i}.attn.conn.post",
        "attn.b_post": "blocks.{i}.attn.conn.b_post",
        "attn.alpha_post": "blocks.{i}.attn.conn.alpha_post",
        "ffn.router": "blocks.{i}.ffn.conn.router",
        "ffn.pre": "blocks.{i}.ffn.conn.pre",
        "ffn.b_pre": "blocks.{i}.ffn.conn.b_pre",
        "ffn.alpha_pre": "blocks.{i}.ffn.conn.alpha_pre",
        "ffn.res": "blocks.{i}.ffn.conn.res",
        "ffn.b_res": "blocks.{i}.ffn.conn.b_res",
        "ffn.alpha_res": "blocks.{i}.ffn.conn.alpha_res",
        "ffn.post": "blocks.{i}.ffn.conn.post",
        "ffn.b_post": "blocks.{i}.ffn.conn.b_post",
        "ffn.alpha_post": "blocks.{i}.ffn.conn.alpha_post",
        "ffn.conv": "blocks.{i}.ffn.conn.conv{j}"
    },
    "connection": {
        "attn.norm_bias": "blocks.{i}.attn.conn.norm_bias",
        "attn.s_alpha": "blocks.{i}.attn.conn.s_alpha",
        "attn.s_beta": "blocks.{i}.attn.conn.s_beta",
        "ffn.norm_bias": "blocks.{i}.ffn.conn.norm_bias",
        "ffn.s_alpha": "blocks.{i}.ffn.conn.s_alpha",
        "ffn.s_beta": "blocks.{i}.ffn.conn.s_beta",
        "permutations": "conn.permutations",
        "kronecker": "conn.kronecker",
        "collapse.readout": "collapse.readout"
    }
}
# END TENSOR_NAMES

# GHC with embed_mode Expand reads these instead of `embed_wide` (docs/math.md §5.2).
GHC_EXPAND_NAMES = {"embed": "embed", "embed_expand": "embed_expand"}

# xHC with temporal_aug MlpAndAttention has the convolutions on the attention too
# (docs/math.md §6.5); outside TENSOR_NAMES, whose xHC list is specs/xhc.ron's (Mlp).
XHC_CONV_NAMES = {"ffn": TENSOR_NAMES["xhc"]["ffn.conv"], "attn": "blocks.{i}.attn.conn.conv{j}"}

# The range of every whole-number spec field this loader reads: [min, max, why],
# the rows of widen's own table (ir/src/spec/limits.rs, INTEGER_LIMITS), so that a
# checkpoint whose spec widen would refuse is refused here too. The literal between
# the BEGIN and END lines is JSON; tests/python_loader.rs checks it against the Rust table.
# BEGIN SPEC_LIMITS
SPEC_LIMITS = {
    "vocab": [256, 2147483648, "token ids are 32-bit integers in the graph"],
    "vocab_pad_to": [1, 65536, "it is an alignment; nanoGPT pads to 64, and 65536 rows of padding would only waste memory"],
    "d_model": [1, 16777216, "widths above 2^24 exceed any model by 1000x"],
    "layers": [1, 1024, "the graph unrolls every block; 1024 is 8x the deepest published language model"],
    "heads": [1, 16777216, "widths above 2^24 exceed any model by 1000x"],
    "kv_heads": [1, 16777216, "widths above 2^24 exceed any model by 1000x"],
    "head_dim": [2, 16777216, "widths above 2^24 exceed any model by 1000x"],
    "ffn.hidden": [1, 16777216, "widths above 2^24 exceed any model by 1000x"],
    "residual.n": [1, 1024, "connections hold n x n maps; the papers use 2..16 streams"],
    "residual.m": [1, 1024, "it is at most residual.n or d_model"],
    "residual.k": [1, 1024, "it is at most residual.n"],
    "residual.fixed": [0, 1024, "it is at most residual.k"],
    "residual.conv_kernels": [1, 1024, "a temporal kernel spans that many positions; the paper's widest is 12"],
    "residual.sinkhorn_iters": [1, 1000, "every sublayer runs them on every step; 20 converge (the papers' setting)"],
    "residual.streams": [1, 1024, "connections hold s x s maps; the papers use 2..16 streams"],
    "residual.segments": [1, 1024, "it is at most residual.streams or d_model"],
    "residual.history.block": [1, 2048, "an entry holds at most every sublayer of the model (2 x layers)"],
    "residual.history.dilation": [1, 2048, "a dilation above the number of entries (2 x layers + 1) reads the newest entry only"],
    "residual.history.period": [1, 2048, "a period above the number of entries (2 x layers + 1) never reads"],
    "residual.carry.constraint.iters": [1, 1000, "every sublayer runs them on every step; 20 converge (the papers' setting)"],
    "mtp.depth": [0, 16, "each module is one more block and head; DeepSeek-V3 uses 1"],
    "parametrization.base_width": [1, 16777216, "it is at most d_model"]
}
# END SPEC_LIMITS

# Most temporal-conv kernels on an xHC sublayer (ir/src/spec/limits.rs, MAX_CONV_KERNELS).
MAX_CONV_KERNELS = 16

# The most streams a `Permutations` carry takes: 6! = 720 logits per sublayer
# (ir/src/spec/connection.rs, MAX_PERMUTATION_STREAMS).
MAX_PERMUTATION_STREAMS = 6

# The residual schemes that are designs of the connection language (docs/connections.md):
# HC, FC, mHC and GHC are spellings of `Connection(...)` and are built by the same code here,
# as widen lowers them by the same code.
CONNECTION_SCHEMES = ("Hc", "Fc", "Mhc", "Ghc", "Connection")

# ---- the safetensors header, read and checked with the standard library ----

# safetensors refuses a header longer than 100 MB (its MAX_HEADER_SIZE), and so does
# widen's reader (runtime/src/checkpoint.rs): a larger length is garbage, not a header.
MAX_HEADER_BYTES = 100_000_000

# Every dtype of the safetensors format and its size in bytes.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip

# The dtypes read_safetensors decodes, as little-endian numpy type strings.
_NUMPY_DTYPES = {
    "BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2", "F16": "<f2",
    "I32": "<i4", "U32": "<u4", "F32": "<f4", "F64": "<f8", "I64": "<i8", "U64": "<u8",
}  # fmt: skip


class TensorEntry:
    """One tensor of a safetensors header: dtype, shape, and its bytes [begin, end)
    relative to the start of the data section."""

    __slots__ = ("dtype", "shape", "begin", "end")

    def __init__(self, dtype, shape, begin, end):
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end

    def __repr__(self):
        return f"TensorEntry({self.dtype}, {self.shape}, [{self.begin}, {self.end}])"


def _whole(value):
    """Whether a JSON value is a whole number (JSON true/false are not, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value):
    """A JSON value as the file spells it, shortened."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = f"<a {type(value).__name__} that cannot be shown>"
    return text if len(text) <= 80 else text[:77] + "..."


def _strict_json(path, what, text):
    """json.loads refusing duplicate object keys (which of two would count is not
    defined) and the NaN/Infinity literals JSON does not have."""

    def pairs(items):
        out = {}
        for key, value in items:
            if key in out:
                raise CheckpointError(f"{path}: {what} has the key {_show(key)} twice; JSON object keys must be unique")
            out[key] = value
        return out

    def constant(name):
        raise CheckpointError(f"{path}: {what} holds {name}, which is not JSON; numbers must be finite")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path}: {what} is not JSON ({e.msg} at line {e.lineno} column {e.colno}); it must be one JSON object"
        ) from None
    except CheckpointError:
        raise
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise CheckpointError(f"{path}: {what} cannot be read as JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: {what} nests too deeply to be read; it must be one flat JSON object") from None


def read_header(path):
    """(tensor entries by name, metadata dict, file offset of the data section) of a
    safetensors file, checked as the format requires (and as safetensors and
    widen's reader check it) before anything is read from the data section:

    - an 8-byte little-endian header length n <= MAX_HEADER_BYTES that fits the file;
    - a header that is one UTF-8 JSON object without duplicate keys;
    - `__metadata__` absent, null, or an object of strings;
    - every other key a tensor {dtype, shape, data_offsets}: a known dtype, a shape
      of whole numbers >= 0, data_offsets [begin, end] of whole numbers with
      begin <= end <= the data section's length, and end - begin = prod(shape) x
      the dtype's size;
    - the tensors' byte ranges, in offset order, follow each other without gap or
      overlap from 0 to the end of the file (the format's rule: every data byte
      belongs to exactly one tensor).

    Needs only the standard library. Raises CheckpointError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(
                f"{path}: the file is {size} bytes long; a safetensors file starts with an 8-byte header length"
            )
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: header length {n} (the file's first 8 bytes, little-endian) is above the "
                f"{MAX_HEADER_BYTES} bytes safetensors allows"
            )
        if n > size - 8:
            raise CheckpointError(
                f"{path}: header length {n} (the file's first 8 bytes, little-endian) runs past the end of the "
                f"file: it is {size} bytes long, so the header can be at most {size - 8} bytes"
            )
        raw = f.read(n)
    if len(raw) != n:
        raise CheckpointError(f"{path}: the file ended after {len(raw)} of its {n} header bytes while being read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path}: the {n}-byte header is not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); "
            "a safetensors header is one JSON object"
        ) from None
    header = _strict_json(path, "the header", text)
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: the header is the JSON {type(header).__name__} {_show(header)}; a safetensors header is one "
            "JSON object of tensors"
        )
    data_start = 8 + n
    data_len = size - data_start
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: header `__metadata__` is {_show(meta)}; it must be an object of strings")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise CheckpointError(
                f"{path}: header `__metadata__` key `{key}` is {_show(value)}; safetensors metadata holds strings only"
            )
    entries = {}
    for name, entry in header.items():
        entries[name] = _tensor_entry(path, name, entry, data_len, n, size)
    _check_coverage(path, entries, data_len)
    return entries, meta, data_start


def _tensor_entry(path, name, entry, data_len, n, size):
    where = f"{path}: tensor `{name}`"
    keys = {"dtype", "shape", "data_offsets"}
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where} is {_show(entry)}; a tensor entry is an object with {sorted(keys)}")
    if set(entry) != keys:
        missing, extra = sorted(keys - set(entry)), sorted(set(entry) - keys)
        raise CheckpointError(
            f"{where} has the keys {sorted(entry)} (missing {missing}, unknown {extra}); a tensor entry has "
            f"exactly {sorted(keys)}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where} has dtype {_show(dtype)}; the safetensors dtypes are {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list):
        raise CheckpointError(f"{where} has shape {_show(shape)}; a shape is a list of whole numbers >= 0")
    for axis, dim in enumerate(shape):
        if not (_whole(dim) and dim >= 0):
            raise CheckpointError(
                f"{where} has shape {_show(shape)}: entry {axis} ({_show(dim)}) must be a whole number >= 0"
            )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) and o >= 0 for o in offsets)):
        raise CheckpointError(
            f"{where} has data_offsets {_show(offsets)}; they must be two whole numbers [begin, end] >= 0"
        )
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where} has data_offsets [{begin}, {end}]; begin must be <= end")
    if end > data_len:
        raise CheckpointError(
            f"{where} has data_offsets [{begin}, {end}], past the end of the data section: it is {data_len} "
            f"bytes (the file's {size} less the 8-byte length and the {n}-byte header)"
        )
    elements = math.prod(shape)
    want = elements * DTYPE_BYTES[dtype]
    if end - begin != want:
        raise CheckpointError(
            f"{where} has shape {shape} of {dtype}, {elements} elements = {want} bytes, but its data_offsets "
            f"[{begin}, {end}] span {end - begin} bytes"
        )
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_coverage(path, entries, data_len):
    """The format's rule: sorted by offset, the tensors' bytes follow each other from
    0 to the end of the data section, without gaps or overlaps."""
    pos, prev = 0, None
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end, item[0])):
        if e.begin < pos:
            raise CheckpointError(
                f"{path}: tensor `{name}` has data_offsets [{e.begin}, {e.end}], which overlap tensor `{prev[0]}` "
                f"at [{prev[1].begin}, {prev[1].end}]; each tensor's bytes must start where the previous "
                f"tensor's end (here at {pos})"
            )
        if e.begin > pos:
            raise CheckpointError(
                f"{path}: bytes [{pos}, {e.begin}) of the data section belong to no tensor (tensor `{name}` starts "
                f"at {e.begin}, the tensors before it end at {pos}); the tensors must cover the data section "
                "without gaps"
            )
        pos, prev = e.end, (name, e)
    if pos != data_len:
        raise CheckpointError(
            f"{path}: the tensors cover bytes [0, {pos}) of the {data_len}-byte data section; the "
            f"{data_len - pos} bytes after them belong to no tensor (they must cover it exactly)"
        )


def read_safetensors(path, names=None):
    """(tensors as numpy arrays by name, header metadata dict) of a safetensors file,
    after read_header's checks; `names` limits which tensors are decoded."""
    entries, meta, data_start = read_header(path)
    tensors = {}
    with open(path, "rb") as f:
        for name in entries if names is None else names:
            e = entries[name]
            if e.dtype not in _NUMPY_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor `{name}` has dtype {e.dtype}; this reader decodes {', '.join(_NUMPY_DTYPES)}"
                )
            f.seek(data_start + e.begin)
            raw = f.read(e.end - e.begin)
            if len(raw) != e.end - e.begin:
                raise CheckpointError(f"{path}: the file ended inside tensor `{name}` while being read")
            tensors[name] = np.frombuffer(raw, dtype=np.dtype(_NUMPY_DTYPES[e.dtype])).reshape(e.shape).copy()
    return tensors, meta


# ---- the embedded spec, checked against widen's ranges ----


def _variant(value):
    """(name, fields) of a serde enum value: "Residual" or {"Ghc": {...}}."""
    if isinstance(value, str):
        return value, {}
    ((name, fields),) = value.items()
    return name, fields


class _SpecReader:
    """Reads the fields of a spec (the JSON form of ir/src/spec's ModelSpec) with
    the rules of ir/src/spec/validate.rs; each failure names the field by its RON
    path, the value and what would be valid."""

    def __init__(self, spec, where):
        self.spec = spec
        self.where = where

    def fail(self, field, value, valid):
        raise CheckpointError(f"{self.where}: {field} = {_show(value)} {valid}")

    def get(self, obj, key, field):
        present = (isinstance(obj, dict) and key in obj) or (
            isinstance(obj, list) and isinstance(key, int) and 0 <= key < len(obj)
        )
        if not present:
            raise CheckpointError(f"{self.where}: no field `{field}` (widen writes every field, defaults filled in)")
        return obj[key]

    def whole(self, obj, key, field, optional=False, row=None):
        value = self.get(obj, key, field)
        if optional and value is None:
            return None
        lo, hi, why = SPEC_LIMITS[row or field]
        if not (_whole(value) and lo <= value <= hi):
            self.fail(field, value, f"must be {'null or ' if optional else ''}a whole number in {lo}..={hi} ({why})")
        return value

    def number(self, obj, key, field, lo_open=None, lo_closed=None, optional=False):
        value = self.get(obj, key, field)
        if optional and value is None:
            return None
        ok = (_whole(value) or isinstance(value, float)) and math.isfinite(value)
        if lo_open is not None:
            ok = ok and value > lo_open
            valid = f"must be {'null or ' if optional else ''}a number > {lo_open} and finite"
        else:
            ok = ok and value >= lo_closed
            valid = f"must be {'null or ' if optional else ''}a number >= {lo_closed} and finite"
        if not ok:
            self.fail(field, value, valid)
        return float(value)

    def boolean(self, obj, key, field, optional=False):
        value = self.get(obj, key, field)
        if not (isinstance(value, bool) or (optional and value is None)):
            self.fail(field, value, f"must be {'null, ' if optional else ''}true or false")
        return value

    def choice(self, obj, key, field, options, optional=False):
        """A unit enum value, one of `options` (or null when optional)."""
        value = self.get(obj, key, field)
        if optional and value is None:
            return None
        if value not in options or not isinstance(value, str):
            self.fail(field, value, f"must be {'null or ' if optional else ''}one of {', '.join(options)}")
        return value

    def variant(self, obj, key, field, units, structs):
        """(name, fields) of an enum value: one of the unit names, or {"Name": {...}} for a struct variant."""
        value = self.get(obj, key, field)
        if isinstance(value, str) and value in units:
            return value, {}
        if isinstance(value, dict) and len(value) == 1:
            ((name, fields),) = value.items()
            if name in structs and isinstance(fields, dict):
                return name, fields
        forms = list(units) + [f"{{{json.dumps(s)}: {{...}}}}" for s in structs]
        self.fail(field, value, f"must be one of {', '.join(forms)}")

    def finite(self, obj, key, field):
        """A finite number of either sign."""
        value = self.get(obj, key, field)
        if not ((_whole(value) or isinstance(value, float)) and math.isfinite(value)):
            self.fail(field, value, "must be a finite number")
        return float(value)

    def enum(self, obj, key, field, units=(), structs=(), newtypes=()):
        """(name, payload) of a serde enum value: a unit name (payload None), {"Name": {...}}
        for a struct variant, or {"Name": value} for a newtype or tuple variant, whose value
        the caller checks."""
        value = self.get(obj, key, field)
        if isinstance(value, str) and value in units:
            return value, None
        if isinstance(value, dict) and len(value) == 1:
            ((name, payload),) = value.items()
            if (name in structs and isinstance(payload, dict)) or name in newtypes:
                return name, payload
        forms = list(units) + [f"{{{json.dumps(s)}: {{...}}}}" for s in structs]
        forms += [f"{{{json.dumps(s)}: ...}}" for s in newtypes]
        self.fail(field, value, f"must be one of {', '.join(forms)}")


class Coefficient:
    """One of a design's read, carry and write (ir/src/spec/connection.rs, Coefficient):
    its constraint, (name, fields) with fields None for a unit variant, its form
    (Matrix or PerSlot), and whether its static part is trained (`learned`; false keeps
    it a constant of class Table, docs/math.md §12.1). Its init only says where widen
    started: a checkpoint holds the values."""

    __slots__ = ("constraint", "form", "learned")

    def __init__(self, constraint=("None", None), form="Matrix", learned=True):
        self.constraint, self.form, self.learned = constraint, form, learned

    def __repr__(self):
        return f"Coefficient({self.constraint}, {self.form}, learned={self.learned})"


class DepthHistory:
    """A design's depth history (ir/src/spec/connection.rs, History; docs/math.md §12.5):
    `entries` ("Outputs" or "States"), `block` sublayers per entry, `weights` ("Attention"
    or the Static init "Newest", "Ones" or "Mean", with `static` true), and for States
    the `dilation` k and `period` p of its reads."""

    __slots__ = ("entries", "block", "weights", "static", "dilation", "period")

    def __init__(self, entries, block, weights, static, dilation, period):
        self.entries, self.block, self.weights, self.static = entries, block, weights, static
        self.dilation, self.period = dilation, period

    def __repr__(self):
        weights = f"Static({self.weights})" if self.static else self.weights
        return (
            f"History(entries: {self.entries}, block: {self.block}, weights: {weights}, "
            f"dilation: {self.dilation}, period: {self.period})"
        )

    def reads(self, sublayers):
        """The reads of a history over `sublayers` sublayers (the trunk's 2L, or an MTP
        module's 2, each starting its own history), as ir/src/lower/schemes/history.rs
        makes them: [(sublayer, sources)], `sources` the indices of the finished entries
        the read combines, in order. With Outputs every sublayer l reads the entries
        0 ..= l // block (and the current block's partial sum, if it has begun, which is
        not an entry); with States a read follows entry i = (l + 1) / block where `block`
        divides l + 1 and the period divides i, over the entries j <= i with
        j ≡ i (mod dilation)."""
        out = []
        for l in range(sublayers):
            if self.entries == "Outputs":
                out.append((l, list(range(l // self.block + 1))))
                continue
            if (l + 1) % self.block:
                continue
            i = (l + 1) // self.block
            if i % self.period == 0:
                out.append((l, [j for j in range(i + 1) if j % self.dilation == i % self.dilation]))
        return out

    def partial(self, sublayer):
        """Outputs: whether the read before `sublayer` (the head's: `sublayer` = the count
        of sublayers) also combines the current block's partial sum."""
        return self.entries == "Outputs" and sublayer % self.block != 0

    def read_count(self, sublayer, sources):
        """n, the values a read combines: its entries and, with Outputs, the partial sum."""
        return len(sources) + self.partial(sublayer)


class ConnectionDesign:
    """A residual-stream design of the connection language (docs/connections.md,
    docs/math.md §12) as the loader builds it: `s` slots of width `ds` = d_model / `m`
    per token; `create` ("Replicate", "Split", "Full" or "Expand", the last two being
    Wide(..)); `collapse` ("Sum", "Mean", "Concat", "Reduce" or "Readout") with
    `reduce_norm` ("GroupNorm" or "Off") or `readout` (a Coefficient); `generator`
    ("None", "PerSlot" or "Flat") with its fields `gen`; and the coefficients `read`,
    `carry`, `write`; and its depth `history` (a DepthHistory, or None). HC, FC, mHC and
    GHC are written into one (`_spelled_design`) as ConnectionSpec::hc and its siblings
    write them (ir/src/spec/connection.rs)."""

    def __init__(self, s, m, d, create, collapse, generator, gen, read, carry, write):
        self.s, self.m, self.ds = s, m, d // m
        self.create, self.collapse = create, collapse
        self.reduce_norm, self.readout = "Off", None
        self.generator, self.gen = generator, gen
        self.read, self.carry, self.write = read, carry, write
        # The depth history (docs/math.md §12.5), a DepthHistory or None.
        self.history = None

    def coefficient(self, which):
        return {"read": self.read, "carry": self.carry, "write": self.write}[which]

    def matrix_shape(self, which):
        """[rows, cols] of a coefficient's matrix, output-major (docs/math.md §0.2)."""
        s, m = self.s, self.m
        if which == "read":
            return [m, s]
        if self.coefficient(which).form == "PerSlot":
            return [s, 1]
        return [s, s] if which == "carry" else [s, m]

    def permutations(self):
        """Whether the carry is a softmax over the s! permutation matrices (docs/math.md §12.2)."""
        return self.carry.constraint[0] == "Permutations"

    def kronecker(self):
        """Whether the carry is a Kronecker product of 2 x 2 factors (docs/math.md §12.6)."""
        return self.carry.constraint[0] == "Kronecker"

    def logits(self, which):
        """How many logits a coefficient has: its entries, s! for `Permutations`, 2 log2(s)
        for `Kronecker`."""
        name = self.coefficient(which).constraint[0]
        if name == "Permutations":
            return math.factorial(self.s)
        if name == "Kronecker":
            return 2 * kronecker_factors(self.s)
        rows, cols = self.matrix_shape(which)
        return rows * cols

    def static_shape(self, which):
        """The shape of a static part (`h_pre`, `h_res`, `h_post`): the matrix, or [1, logits]
        for the structured carries."""
        if self.coefficient(which).constraint[0] in ("Permutations", "Kronecker"):
            return [1, self.logits(which)]
        return self.matrix_shape(which)

    def width(self):
        """The per-token state width s · d_s."""
        return self.s * self.ds

    def outputs(self):
        """Whether a history of outputs replaces the fixed state: no sublayer then has
        a read, carry or write of its own (ir/src/lower/schemes/history.rs)."""
        return self.history is not None and self.history.entries == "Outputs"

    def constant_roles(self):
        """The roles (as in _design_sublayer_tensors) of the static parts that are
        constants, `learned: false` (class Table, never trained): `h_pre`, `h_res`,
        `h_post` one by one, or a Flat generator's `bias`, which holds all three and is
        a constant only when all three are (docs/math.md §12.1)."""
        if self.generator == "Flat":
            return ["bias"] if not self.read.learned else []
        roles = zip(("h_pre", "h_res", "h_post"), (self.read, self.carry, self.write))
        return [role for role, coef in roles if not coef.learned]


def _spelled_design(scheme, cfg, s):
    """HC, FC, mHC or GHC (fields checked by check_spec) written in the connection
    language, as ConnectionSpec::hc, ::fc, ::mhc and ::ghc write them."""
    generator = "PerSlot" if cfg.get("dynamic") else "None"
    plain = dict(read=Coefficient(), carry=Coefficient(), write=Coefficient())
    if scheme == "Hc":
        gen = {"norm": cfg["gen_norm"], "temperature": 1.0, "act": cfg["act"], "gate": "Paired"}
        return ConnectionDesign(
            cfg["n"], 1, s.d, create="Replicate", collapse="Sum", generator=generator, gen=gen, **plain
        )
    if scheme == "Fc":
        gen = {"norm": "RmsNorm", "temperature": 1.0, "act": cfg["act"], "gate": "Paired"}
        plain["write"] = Coefficient(form="PerSlot")
        return ConnectionDesign(
            cfg["m"], cfg["m"], s.d, create="Split", collapse="Concat", generator=generator, gen=gen, **plain
        )
    if scheme == "Mhc":
        return ConnectionDesign(
            cfg["n"], 1, s.d, create="Replicate", collapse=cfg["collapse"], generator="Flat", gen={"gain": False},
            read=Coefficient(("Sigmoid", {"scale": 1.0, "offset": cfg["pre_eps"]})),
            carry=Coefficient(("Sinkhorn", {"iters": cfg["sinkhorn_iters"], "eps": cfg["sinkhorn_eps"]})),
            write=Coefficient(("Sigmoid", {"scale": cfg["post_max"], "offset": 0.0})),
        )  # fmt: skip
    # Ghc
    gen = {"norm": "RmsNorm", "temperature": cfg["tau"], "act": "Tanh", "gate": "Entrywise"}
    design = ConnectionDesign(
        cfg["n"], cfg["m"], s.d, create=cfg["embed_mode"], collapse="Reduce", generator=generator, gen=gen, **plain
    )
    design.reduce_norm = s.reduce_norm
    return design


def _read_coefficient(r, obj, path, s, shape, per_slot):
    """The Coefficient at `path` (`residual.read`, ...) of a `shape` [rows, cols] matrix,
    checked as ir/src/spec/validate.rs (check_coefficient) checks it: a constraint that
    fits the shape, an init of the right length and range. `per_slot`: the generator is
    PerSlot, which cannot make the s! logits of Permutations."""
    if not isinstance(obj, dict):
        r.fail(path, obj, "must be an object {init, constraint, form}")
    square = shape[0] == shape[1] == s
    constraint = r.enum(
        obj,
        "constraint",
        f"{path}.constraint",
        ("None", "Tanh", "Softmax", "Permutations", "Kronecker"),
        ("Sigmoid", "Sinkhorn"),
    )
    name, fields = constraint
    if name == "Sigmoid":
        fields = {
            "scale": r.finite(fields, "scale", f"{path}.constraint.scale"),
            "offset": r.finite(fields, "offset", f"{path}.constraint.offset"),
        }
    elif name == "Sinkhorn":
        if not square or path != "residual.carry":
            r.fail(f"{path}.constraint", obj["constraint"], "cannot be Sinkhorn: it needs a square carry (form: Matrix)")
        fields = {
            "iters": r.whole(fields, "iters", f"{path}.constraint.iters"),
            "eps": r.number(fields, "eps", f"{path}.constraint.eps", lo_closed=0),
        }
    elif name == "Permutations":
        if not square or path != "residual.carry":
            r.fail(
                f"{path}.constraint", name, "mixes s x s permutation matrices, so only a carry with form: Matrix takes it"
            )
        if s > MAX_PERMUTATION_STREAMS:
            r.fail(
                f"{path}.constraint",
                name,
                f"has streams! = {s}! logits; it takes streams <= {MAX_PERMUTATION_STREAMS} (use Sinkhorn)",
            )
        if per_slot:
            r.fail(
                f"{path}.constraint",
                name,
                "needs the s! logits of a Flat generator (or none); PerSlot makes one row per slot",
            )
    elif name == "Kronecker":
        if not square or path != "residual.carry":
            r.fail(
                f"{path}.constraint", name, "builds an s x s carry from 2 x 2 factors, so only a carry with form: Matrix takes it"
            )
        if kronecker_factors(s) == 0:
            r.fail(f"{path}.constraint", name, f"needs streams = 2^K for K >= 1 factors (2, 4, 8, ...), got {s}")
        if per_slot:
            r.fail(
                f"{path}.constraint",
                name,
                "needs the 2K logits of a Flat generator (or none); PerSlot makes one row per slot",
            )
    if name == "Permutations":
        logits = math.factorial(s)
    elif name == "Kronecker":
        logits = 2 * kronecker_factors(s)
    else:
        logits = shape[0] * shape[1]
    units, structs = ("Identity", "Cyclic"), ("Home", "Eye", "First")
    init, value = r.enum(obj, "init", f"{path}.init", units, structs, ("Constant", "Logit", "Linspace", "Values"))
    if init in ("Home", "Eye", "First"):
        r.finite(value, "on", f"{path}.init.on")
        r.finite(value, "off", f"{path}.init.off")
        if init == "Home" and 1 not in shape:
            r.fail(f"{path}.init", obj["init"], f"marks one slot of a [1, s] or [s, 1] coefficient; this one is {shape}")
    elif init == "Constant":
        r.finite(obj["init"], "Constant", f"{path}.init.Constant")
    elif init == "Logit":
        p = r.finite(obj["init"], "Logit", f"{path}.init.Logit")
        if not 0 < p < 1:
            r.fail(f"{path}.init.Logit", value, "must be in (0, 1)")
    elif init in ("Linspace", "Values"):
        if not isinstance(value, list) or (init == "Linspace" and len(value) != 2):
            valid = "must be [lo, hi]" if init == "Linspace" else "must be a list of numbers"
            r.fail(f"{path}.init.{init}", value, valid)
        if init == "Values" and len(value) != logits:
            r.fail(f"{path}.init.Values", value, f"has {len(value)} numbers; this coefficient has {logits} logits")
        for j in range(len(value)):
            r.finite(value, j, f"{path}.init.{init}[{j}]")
    form = r.choice(obj, "form", f"{path}.form", ("Matrix", "PerSlot"))
    # Checkpoints written before `learned` existed have no such field: trained, as then.
    learned = r.boolean(obj, "learned", f"{path}.learned") if "learned" in obj else True
    return Coefficient((name, fields), form, learned)


def _read_connection(r, cfg, d, layers):
    """The ConnectionDesign of a `Connection(...)` spec, every field checked with the
    rules of ir/src/spec/validate.rs (check_connection), with its `history` (a
    DepthHistory, or None when the spec has none) checked as check_history checks it."""
    s = r.whole(cfg, "streams", "residual.streams")
    m = r.whole(cfg, "segments", "residual.segments")
    if d % m != 0:
        r.fail("residual.segments", m, f"must divide d_model = {d} (slots of width d_model / segments)")
    if m > s:
        r.fail("residual.segments", m, f"must be <= residual.streams = {s}")
    create, mode = r.enum(cfg, "create", "residual.create", ("Replicate", "Split"), (), ("Wide",))
    if create == "Wide":
        if mode not in ("Full", "Expand") or not isinstance(mode, str):
            r.fail("residual.create", cfg["create"], 'must be "Replicate", "Split", {"Wide": "Full"} or {"Wide": "Expand"}')
        create = mode
    if create == "Replicate" and m != 1:
        r.fail(
            "residual.create",
            create,
            f"copies the d_model-wide embedding into every slot, so it needs segments = 1 (got {m}); use Split or Wide",
        )
    if create == "Split" and s != m:
        r.fail(
            "residual.create",
            create,
            f"cuts the embedding into segments, so it needs streams = segments (got {s} and {m}); use Wide",
        )
    collapse, fields = r.enum(cfg, "collapse", "residual.collapse", ("Sum", "Mean", "Concat"), ("Reduce", "Readout"))
    if collapse in ("Sum", "Mean", "Readout") and m != 1:
        r.fail(
            "residual.collapse",
            cfg["collapse"],
            f"adds d_model-wide slots, so it needs segments = 1 (got {m}); use Concat or Reduce",
        )
    if collapse == "Concat" and s != m:
        r.fail(
            "residual.collapse",
            collapse,
            f"puts the slots side by side, so it needs streams = segments (got {s} and {m}); use Reduce",
        )
    reduce_norm, readout = "Off", None
    if collapse == "Reduce":
        reduce_norm = r.choice(fields, "norm", "residual.collapse.norm", ("GroupNorm", "Off"))
        r.choice(fields, "init", "residual.collapse.init", ("BlockIdentity", "Normal"))
        if reduce_norm == "GroupNorm" and s % m != 0:
            r.fail(
                "residual.collapse.norm",
                reduce_norm,
                f"has groups of size d_model, so it needs streams = {s} to be a multiple of segments = {m}; use Off",
            )
    if collapse == "Readout":
        readout = _read_coefficient(r, fields, "residual.collapse", s, [1, s], True)
        if readout.form != "Matrix":
            r.fail("residual.collapse.form", readout.form, "must be Matrix: Readout weighs the slots with one [1, s] row")
    generator, gen = r.enum(cfg, "generator", "residual.generator", ("None",), ("PerSlot", "Flat"))
    if generator == "PerSlot":
        gen = {
            "norm": r.choice(gen, "norm", "residual.generator.norm", ("LayerNorm", "RmsNorm")),
            "temperature": r.number(gen, "temperature", "residual.generator.temperature", lo_open=0, optional=True),
            "act": r.choice(gen, "act", "residual.generator.act", ("Tanh", "Identity")),
            "gate": r.choice(gen, "gate", "residual.generator.gate", ("Paired", "Entrywise")),
            "gate_init": r.finite(gen, "gate_init", "residual.generator.gate_init"),
        }
    elif generator == "Flat":
        gen = {
            "gain": r.boolean(gen, "gain", "residual.generator.gain"),
            "proj_init": r.choice(gen, "proj_init", "residual.generator.proj_init", ("Zero", "Xavier")),
            "gate_init": r.finite(gen, "gate_init", "residual.generator.gate_init"),
        }
    per_slot = generator == "PerSlot"

    def coef(which, shape):
        return _read_coefficient(r, r.get(cfg, which, f"residual.{which}"), f"residual.{which}", s, shape, per_slot)

    read = coef("read", [m, s])
    if read.form != "Matrix":
        r.fail("residual.read.form", read.form, "must be Matrix: the read is always [segments, streams]")
    carry_form = r.get(r.get(cfg, "carry", "residual.carry"), "form", "residual.carry.form")
    carry = coef("carry", [s, 1] if carry_form == "PerSlot" else [s, s])
    write_form = r.get(r.get(cfg, "write", "residual.write"), "form", "residual.write.form")
    if write_form == "PerSlot" and s != m:
        r.fail(
            "residual.write.form",
            write_form,
            f"sends segment i to slot i, so it needs streams = segments (got {s} and {m}); use Matrix",
        )
    write = coef("write", [s, 1] if write_form == "PerSlot" else [s, m])
    if generator == "Flat" and not (read.learned == carry.learned == write.learned):
        r.fail(
            "residual.read.learned",
            read.learned,
            "must be the learned of carry and write too: with generator: Flat one bias holds the static parts of "
            f"read, carry and write (here read {read.learned}, carry {carry.learned}, write {write.learned})",
        )
    r.choice(cfg, "out_proj_std_mult", "residual.out_proj_std_mult", ("One", "InvSqrtN", "SqrtN"))
    design = ConnectionDesign(s, m, d, create, collapse, generator, gen, read, carry, write)
    design.reduce_norm, design.readout = reduce_norm, readout
    # Checkpoints written before the depth history existed have no `history` field.
    raw = cfg.get("history")
    design.history = None if raw is None else _read_history(r, raw, cfg, layers)
    return design


# The plain one-slot read, carry and write (ConnectionSpec::default) in the JSON form
# widen writes: what a history of outputs needs the coefficients to be (validate.rs).
_PLAIN_COEFFICIENTS = {
    "read": {"init": {"Home": {"on": 1.0, "off": 0.0}}, "constraint": "None", "form": "Matrix", "learned": True},
    "carry": {"init": "Identity", "constraint": "None", "form": "Matrix", "learned": True},
    "write": {"init": {"Constant": 1.0}, "constraint": "None", "form": "Matrix", "learned": True},
}


def _is_plain(which, value):
    """Whether a coefficient's JSON is ConnectionSpec::default's (`learned` absent: true)."""
    want = _PLAIN_COEFFICIENTS[which]
    if not isinstance(value, dict):
        return False
    value = dict(value)
    value.setdefault("learned", True)
    return _json_equal(value, want)


def _json_equal(a, b):
    """JSON values equal as serde would read them: numbers by value (1 and 1.0 alike),
    booleans only as booleans."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _read_history(r, h, cfg, layers):
    """The DepthHistory of `residual.history`, checked with the rules of
    ir/src/spec/validate.rs (check_history): block, dilation and period within their
    SPEC_LIMITS rows, block <= 2 x layers, and with entries: Outputs, which replaces the
    fixed state, dilation and period 1 and the design's other fields at their one-slot
    defaults (streams 1, segments 1, Replicate, Sum, no generator, the plain read, carry
    and write)."""
    if not isinstance(h, dict):
        r.fail("residual.history", h, "must be null or an object {entries, block, weights, dilation, period}")
    entries = r.choice(h, "entries", "residual.history.entries", ("Outputs", "States"))
    block = r.whole(h, "block", "residual.history.block")
    weights, init = r.enum(h, "weights", "residual.history.weights", ("Attention",), (), ("Static",))
    if weights == "Static":
        if init not in ("Newest", "Ones", "Mean") or not isinstance(init, str):
            r.fail(
                "residual.history.weights",
                h["weights"],
                'must be "Attention", {"Static": "Newest"}, {"Static": "Ones"} or {"Static": "Mean"}',
            )
    dilation = r.whole(h, "dilation", "residual.history.dilation")
    period = r.whole(h, "period", "residual.history.period")
    if block > 2 * layers:
        r.fail(
            "residual.history.block",
            block,
            f"must be <= 2 x layers = {2 * layers}: an entry holds `block` consecutive sublayers",
        )
    if entries == "Outputs":
        for field, value in (("residual.history.dilation", dilation), ("residual.history.period", period)):
            if value != 1:
                r.fail(
                    field,
                    value,
                    "must be 1: with entries: Outputs every sublayer reads every entry; dilation and period apply "
                    "to entries: States",
                )
        fixed = [
            ("residual.streams", _json_equal(cfg["streams"], 1), "streams: 1"),
            ("residual.segments", _json_equal(cfg["segments"], 1), "segments: 1 (or leave it out)"),
            ("residual.create", cfg["create"] == "Replicate", "create: Replicate (or leave it out)"),
            (
                "residual.collapse",
                cfg["collapse"] == "Sum",
                "collapse: Sum (or leave it out); the head reads the history",
            ),
            ("residual.generator", cfg["generator"] == "None", "generator: None (or leave it out)"),
        ]
        fixed += [(f"residual.{w}", _is_plain(w, cfg[w]), f"{w} left out") for w in ("read", "carry", "write")]
        for field, ok, what in fixed:
            if not ok:
                r.fail(
                    field,
                    cfg[field.split(".")[1]],
                    f"is not allowed here: residual.history with entries: Outputs replaces the fixed state (every "
                    f"sublayer reads the history, nothing is carried), so it needs {what}; for a history beside a "
                    "fixed state use entries: States",
                )
    static = weights == "Static"
    return DepthHistory(entries, block, init if static else "Attention", static, dilation, period)


class SpecSizes:
    """The sizes and settings of a spec the loader reads, resolved (defaults that
    depend on other fields filled in) and checked."""

    def summary(self):
        """The sizes a model's tensor shapes follow from, for messages."""
        parts = [
            f"vocab = {self.vocab}",
            f"d_model = {self.d}",
            f"layers = {self.layers}",
            f"heads = {self.heads}",
            f"kv_heads = {self.kv_heads}",
            f"head_dim = {self.head_dim}",
            f"ffn.hidden = {self.hidden}",
        ]
        if self.scheme == "Mhc":
            parts.append(f"residual = Mhc(n: {self.n})")
        elif self.scheme == "Ghc":
            parts.append(f"residual = Ghc(m: {self.m}, n: {self.n}, dynamic: {json.dumps(self.cfg['dynamic'])})")
        elif self.scheme == "Hc":
            parts.append(f"residual = Hc(n: {self.n}, dynamic: {json.dumps(self.cfg['dynamic'])})")
        elif self.scheme == "Fc":
            parts.append(f"residual = Fc(m: {self.m}, dynamic: {json.dumps(self.cfg['dynamic'])})")
        elif self.scheme == "Connection":
            c = self.design
            history = "" if c.history is None else f", history: {c.history}"
            parts.append(f"residual = Connection(streams: {c.s}, segments: {c.m}, generator: {c.generator}{history})")
        elif self.scheme == "Xhc":
            parts.append(f"residual = Xhc(n: {self.n}, k: {self.k}, fixed: {self.fixed}, conv_kernels: {self.kernels})")
        else:
            parts.append(f"residual = {self.scheme}")
        if self.mtp_depth:
            parts.append(f"mtp.depth = {self.mtp_depth}")
        parts.append(f"tie_embeddings = {json.dumps(self.tied)}")
        return ", ".join(parts)


def check_spec(spec, where="spec"):
    """The SpecSizes of a spec (the JSON form of widen's ModelSpec, as in a checkpoint's
    `spec_json`), after checking every field this loader reads within the ranges
    widen's validation applies (ir/src/spec/limits.rs, ir/src/spec/validate.rs).
    Raises CheckpointError naming `where`, the field, its value and what is valid;
    NotImplementedError for a valid configuration this loader does not build."""
    r = _SpecReader(spec, where)
    if not isinstance(spec, dict):
        raise CheckpointError(f"{where}: the spec is {_show(spec)}; it must be a JSON object (a widen ModelSpec)")
    s = SpecSizes()
    s.vocab = r.whole(spec, "vocab", "vocab")
    # The embedding and output rows: vocab rounded up to a multiple of vocab_pad_to
    # (docs/data.md); absent from checkpoints written before padding existed.
    pad = r.whole(spec, "vocab_pad_to", "vocab_pad_to", optional=True) if "vocab_pad_to" in spec else None
    if pad is not None and pad > 1:
        s.vocab = -(-s.vocab // pad) * pad
    s.d = r.whole(spec, "d_model", "d_model")
    s.layers = r.whole(spec, "layers", "layers")
    s.heads = r.whole(spec, "heads", "heads")
    kv = r.whole(spec, "kv_heads", "kv_heads", optional=True)
    if kv is not None and (kv > s.heads or s.heads % kv != 0):
        r.fail("kv_heads", kv, f"must divide heads = {s.heads} (1..=heads, heads a multiple of it), or be null")
    s.kv_heads = kv if kv is not None else s.heads
    dh = r.whole(spec, "head_dim", "head_dim", optional=True)
    if dh is not None and dh % 2 != 0:
        r.fail("head_dim", dh, "must be even (RoPE rotates pairs), or null")
    if dh is None:
        if s.d % s.heads != 0:
            r.fail(
                "d_model", s.d, f"is not divisible by heads = {s.heads} (head_dim is null, so it is d_model / heads)"
            )
        dh = s.d // s.heads
        if dh < 2 or dh % 2 != 0:
            r.fail("head_dim", dh, "(d_model / heads, head_dim being null) must be even and >= 2 (RoPE rotates pairs)")
    s.head_dim = dh
    ffn, ffn_cfg = r.variant(spec, "ffn", "ffn", (), ("SwiGlu", "Moe"))
    s.ffn = ffn
    s.hidden = None
    if ffn == "SwiGlu":
        hidden = r.whole(ffn_cfg, "hidden", "ffn.hidden", optional=True)
        # FfnSpec::default_hidden: ceil(8D/3) rounded up to a multiple of 8 below D = 96, of 256 from there.
        multiple = 8 if s.d < 96 else 256
        raw = -(-8 * s.d // 3)
        s.hidden = hidden if hidden is not None else -(-raw // multiple) * multiple
    s.norm_eps = r.number(spec, "norm_eps", "norm_eps", lo_open=0)
    s.rope_base = r.number(spec, "rope_base", "rope_base", lo_open=0)
    s.tied = r.boolean(spec, "tie_embeddings", "tie_embeddings")
    scheme, cfg = r.variant(spec, "residual", "residual", ("Residual",), CONNECTION_SCHEMES + ("Xhc",))
    s.scheme, s.cfg = scheme, cfg
    s.n = s.m = s.k = s.fixed = None
    s.kernels = []
    s.design = None
    if scheme == "Hc":
        s.n = r.whole(cfg, "n", "residual.n")
        r.boolean(cfg, "dynamic", "residual.dynamic")
        r.choice(cfg, "act", "residual.act", ("Tanh", "Identity"))
        r.choice(cfg, "gen_norm", "residual.gen_norm", ("LayerNorm", "RmsNorm"))
        r.finite(cfg, "scale_init", "residual.scale_init")
        r.choice(cfg, "out_proj_std_mult", "residual.out_proj_std_mult", ("One", "InvSqrtN", "SqrtN"))
    elif scheme == "Fc":
        s.m = r.whole(cfg, "m", "residual.m")
        if s.d % s.m != 0:
            r.fail("residual.m", s.m, f"must divide d_model = {s.d} (fractions of width d_model / m)")
        r.boolean(cfg, "dynamic", "residual.dynamic")
        r.choice(cfg, "act", "residual.act", ("Tanh", "Identity"))
        r.finite(cfg, "scale_init", "residual.scale_init")
    elif scheme == "Connection":
        s.design = _read_connection(r, cfg, s.d, s.layers)
    elif scheme == "Mhc":
        s.n = r.whole(cfg, "n", "residual.n")
        r.whole(cfg, "sinkhorn_iters", "residual.sinkhorn_iters")
        r.number(cfg, "sinkhorn_eps", "residual.sinkhorn_eps", lo_closed=0)
        r.number(cfg, "pre_eps", "residual.pre_eps", lo_closed=0)
        r.number(cfg, "post_max", "residual.post_max", lo_open=0)
        r.choice(cfg, "collapse", "residual.collapse", ("Sum", "Mean"))
    elif scheme == "Ghc":
        s.m = r.whole(cfg, "m", "residual.m")
        if s.d % s.m != 0:
            r.fail("residual.m", s.m, f"must divide d_model = {s.d} (segments of width d_model / m)")
        s.n = r.whole(cfg, "n", "residual.n")
        if s.n < s.m:
            r.fail("residual.n", s.n, f"must be >= residual.m = {s.m}")
        r.boolean(cfg, "dynamic", "residual.dynamic")
        r.number(cfg, "tau", "residual.tau", lo_open=0, optional=True)
        r.choice(cfg, "embed_mode", "residual.embed_mode", ("Full", "Expand"))
        norm = r.choice(cfg, "reduce_norm", "residual.reduce_norm", ("GroupNorm", "Off"), optional=True)
        if norm == "GroupNorm" and s.n % s.m != 0:
            r.fail(
                "residual.reduce_norm",
                norm,
                f"requires residual.n = {s.n} to be a multiple of residual.m = {s.m} (groups of size d_model); "
                "valid here: Off or null",
            )
        # GhcSpec::reduce_norm: GroupNorm by default when r = n / m is a whole number >= 2.
        s.reduce_norm = norm or ("GroupNorm" if s.n % s.m == 0 and s.n >= 2 * s.m else "Off")
    elif scheme == "Xhc":
        s.n = r.whole(cfg, "n", "residual.n")
        s.k = r.whole(cfg, "k", "residual.k")
        if s.k > s.n:
            r.fail("residual.k", s.k, f"must be <= residual.n = {s.n}")
        s.fixed = r.whole(cfg, "fixed", "residual.fixed")
        if s.fixed > s.k:
            r.fail("residual.fixed", s.fixed, f"must be <= residual.k = {s.k}")
        kernels = r.get(cfg, "conv_kernels", "residual.conv_kernels")
        if not isinstance(kernels, list) or len(kernels) > MAX_CONV_KERNELS:
            r.fail("residual.conv_kernels", kernels, f"must be a list of at most {MAX_CONV_KERNELS} kernel sizes")
        for j in range(len(kernels)):
            r.whole(kernels, j, f"residual.conv_kernels[{j}]", row="residual.conv_kernels")
        s.kernels = kernels
        r.choice(cfg, "temporal_aug", "residual.temporal_aug", ("Mlp", "MlpAndAttention"))
        r.boolean(cfg, "gram_schmidt", "residual.gram_schmidt", optional=True)
        r.number(cfg, "gs_eps", "residual.gs_eps", lo_open=0)
        r.choice(cfg, "router", "residual.router", ("Sigmoid", "Softmax"))
        r.whole(cfg, "sinkhorn_iters", "residual.sinkhorn_iters")
        r.boolean(cfg, "row_clamp", "residual.row_clamp")
        flash = r.choice(cfg, "flash", "residual.flash", ("None", "Block", "TwoBlock"))
        if flash == "TwoBlock" and s.layers % 2 != 0:
            r.fail("residual.flash", flash, f"needs an even number of layers, but layers = {s.layers}")
    mtp = r.get(spec, "mtp", "mtp")
    s.mtp_depth = r.whole(mtp, "depth", "mtp.depth")
    par, mup = r.variant(spec, "parametrization", "parametrization", ("Standard",), ("MuP",))
    if par == "MuP":
        base = r.whole(mup, "base_width", "parametrization.base_width")
        if base > s.d:
            r.fail("parametrization.base_width", base, f"must be in 1..=d_model (d_model = {s.d})")
        r.number(mup, "attn_mult", "parametrization.attn_mult", lo_open=0)
        r.number(mup, "output_mult", "parametrization.output_mult", lo_open=0)
    precision = r.choice(spec, "precision", "precision", ("F32", "Bf16"))
    train = r.get(spec, "train", "train")
    r.variant(train, "optimizer", "train.optimizer", (), ("AdamW", "Muon"))
    if scheme in CONNECTION_SCHEMES and s.design is None:
        s.design = _spelled_design(scheme, cfg, s)
    if s.design is not None and s.tied and s.design.create == "Full" and s.design.width() != s.d:
        r.fail(
            "tie_embeddings",
            True,
            f"needs a vocab x d_model embedding to tie the head to; create Wide(Full) makes one of width "
            f"{s.design.width()} (streams x d_model / segments), not d_model = {s.d}",
        )
    # Valid, but not built here.
    if ffn != "SwiGlu":
        raise NotImplementedError(f"{where}: ffn {ffn}: only the SwiGlu FFN is built")
    if precision != "F32":
        raise NotImplementedError(f"{where}: precision {precision}: only F32 is built")
    if scheme == "Xhc" and cfg["flash"] != "None":
        raise NotImplementedError(f"{where}: xHC flash {cfg['flash']}: only full xHC (flash: None) is built")
    return s


# ---- the parameter set a spec implies ----


def _backbone_shape(role, s):
    d, f = s.d, s.hidden
    qdim, kvdim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {
        "embed": [s.vocab, d],
        "final_norm": [d],
        "unembed": [d, s.vocab],
        "attn.norm": [d],
        "attn.wq": [d, qdim],
        "attn.wk": [d, kvdim],
        "attn.wv": [d, kvdim],
        "attn.wo": [qdim, d],
        "ffn.norm": [d],
        "ffn.w1": [d, f],
        "ffn.w2": [f, d],
        "ffn.w3": [d, f],
    }[role]


def _xhc_shape(role, s):
    """The shape of an xHC connection tensor (docs/checkpoints.md, "xHC")."""
    sub, _, kind = role.partition(".")
    n, k, d = s.n, s.k, s.d
    # K_r = 1 + len(conv_kernels) on augmented sublayers.
    kr = len(s.kernels) + 1 if _xhc_augmented(s, sub) else 1
    return {
        "router": [n * d, n],
        "pre": [n * d, n],
        "b_pre": [n],
        "alpha_pre": [1],
        "res": [k * d, k * k],
        "b_res": [k, k],
        "alpha_res": [1],
        "post": [k * d, k * kr],
        "b_post": [k, kr],
        "alpha_post": [1],
    }[kind]


def _xhc_augmented(s, sub):
    return len(s.kernels) > 0 and (sub == "ffn" or s.cfg["temporal_aug"] == "MlpAndAttention")


def connection_name(role):
    """The name template of a connection-language tensor (`attn.h_pre`, `ffn.phi`,
    `reduce.w`, `permutations`, ...): one of the TENSOR_NAMES lists "connection",
    "ghc" and "mhc", which together hold every name the designs have."""
    for group in ("connection", "ghc", "mhc"):
        if role in TENSOR_NAMES[group]:
            return TENSOR_NAMES[group][role]
    return GHC_EXPAND_NAMES[role]


def _design_sublayer_tensors(c, kind):
    """(role, shape) of the connection tensors of one sublayer (`kind` "attn" or "ffn"),
    as ir/src/lower/schemes/connection.rs creates them: the static parts without a
    generator or with PerSlot; the PerSlot generator's norm, projections and gates; the
    Flat generator's fused projection, gates and bias (columns [read | write | carry])."""
    ds, m, width = c.ds, c.m, c.width()
    out = []
    if c.generator != "Flat":
        out += [("h_pre", c.static_shape("read")), ("h_res", c.static_shape("carry"))]
        out += [("h_post", c.static_shape("write"))]
    if c.generator == "PerSlot":
        carry_cols, write_cols = c.matrix_shape("carry")[1], c.matrix_shape("write")[1]
        out.append(("norm", [ds]))
        if c.gen["norm"] == "LayerNorm":
            out.append(("norm_bias", [ds]))
        out += [("w_alpha", [ds, m + carry_cols]), ("w_beta", [ds, write_cols])]
        if c.gen["gate"] == "Paired":
            out += [("s_alpha", [1]), ("s_beta", [1])]
        else:
            out += [("s_pre", c.matrix_shape("read")), ("s_res", c.matrix_shape("carry"))]
            out += [("s_post", c.matrix_shape("write"))]
    if c.generator == "Flat":
        cols = c.logits("read") + c.logits("write") + c.logits("carry")
        out += [("phi", [width, cols]), ("alpha", [3]), ("bias", [cols])]
        if c.gen["gain"]:
            out.append(("norm", [width]))
    return [(f"{kind}.{role}", shape) for role, shape in out]


def _design_global_tensors(c, s):
    """(name, shape) of a design's tensors outside the blocks: the embedding (created by
    replication or split: `embed`; Wide: `embed_wide`, or `embed` and `embed_expand`),
    the collapse's weights and the permutation table."""
    out = []
    if c.create == "Full":
        out.append((connection_name("embed_wide"), [s.vocab, c.width()]))
    else:
        out.append((TENSOR_NAMES["backbone"]["embed"], _backbone_shape("embed", s)))
        if c.create == "Expand":
            out.append((connection_name("embed_expand"), [s.d, c.width()]))
    if c.collapse == "Reduce":
        if c.reduce_norm == "GroupNorm":
            out += [(connection_name("reduce.norm"), [c.width()]), (connection_name("reduce.norm_bias"), [c.width()])]
        out.append((connection_name("reduce.w"), [c.width(), s.d]))
    if c.collapse == "Readout":
        out.append((connection_name("collapse.readout"), [1, c.s]))
    if c.permutations():
        out.append((connection_name("permutations"), [math.factorial(c.s), c.s * c.s]))
    if c.kronecker():
        out.append((connection_name("kronecker"), [2 * kronecker_factors(c.s), c.s * c.s]))
    return out


def _block_tensors(s, block):
    """(name, shape) of every tensor of one block, named `block` (`blocks.3`, `mtp.1.block`)."""
    out = []

    def add(tmpl, shape_of):
        name = tmpl.replace("blocks.{i}", block)
        if "{j}" in name:
            out.extend((name.format(j=j), [kappa, s.d]) for j, kappa in enumerate(s.kernels))
        else:
            out.append((name, shape_of()))

    for role, tmpl in TENSOR_NAMES["backbone"].items():
        if "{i}" in tmpl:
            add(tmpl, lambda role=role: _backbone_shape(role, s))
    if s.design is not None and not s.design.outputs():
        for kind in ("attn", "ffn"):
            for role, shape in _design_sublayer_tensors(s.design, kind):
                add(connection_name(role), lambda shape=shape: shape)
    elif s.scheme == "Xhc":
        for role, tmpl in TENSOR_NAMES["xhc"].items():
            sub, _, kind = role.partition(".")
            if kind == "router" and s.fixed >= s.k:
                continue
            if kind == "conv":
                continue  # below, for each augmented sublayer
            add(tmpl, lambda role=role: _xhc_shape(role, s))
        for sub in ("attn", "ffn"):
            if _xhc_augmented(s, sub):
                add(XHC_CONV_NAMES[sub], None)
    return out


def _sublayer_prefix(l, module=None):
    """The parameter prefix of sublayer l of the trunk (`blocks.3.ffn`) or of MTP module
    `module`'s block (`mtp.1.block.attn`), as Cx::sublayer_prefix names it."""
    kind = "attn" if l % 2 == 0 else "ffn"
    return f"blocks.{l // 2}.{kind}" if module is None else f"mtp.{module}.block.{kind}"


def history_tensors(c, sublayers, module=None):
    """(name, shape) of the depth reads of a design's history (docs/checkpoints.md, the
    `history.*` names) over the trunk's `sublayers` (module None) or MTP module
    `module`'s two, whose history is its own (docs/math.md §12.5 DECISION (MTP)): per
    read `{p}.history.query` and `.norm` [W] with attention weights, `{p}.history.weights`
    [n] with static ones, W = s · d_s; with entries: Outputs also the head's read
    (`history.*`, `mtp.{k}.history.*`)."""
    h = c.history
    reads = [(f"{_sublayer_prefix(l, module)}.history", h.read_count(l, src)) for l, src in h.reads(sublayers)]
    if h.entries == "Outputs":
        head = "history" if module is None else f"mtp.{module}.history"
        reads.append((head, h.read_count(sublayers, range(sublayers // h.block + 1))))
    out = []
    for prefix, n in reads:
        if h.static:
            out.append((f"{prefix}.weights", [n]))
        else:
            out += [(f"{prefix}.query", [c.width()]), (f"{prefix}.norm", [c.width()])]
    return out


def constant_parameters(spec):
    """The names of the parameters that are constants of class Table, never trained
    (widen's gradient of them is zero): the permutation table (docs/math.md §12.2) and
    the static parts with `learned: false` (§12.1), over the trunk and MTP modules."""
    s = spec if isinstance(spec, SpecSizes) else check_spec(spec)
    c = s.design
    if c is None:
        return set()
    out = set()
    if c.permutations():
        out.add(connection_name("permutations"))
    if c.kronecker():
        out.add(connection_name("kronecker"))
    if c.readout is not None and not c.readout.learned:
        out.add(connection_name("collapse.readout"))
    if not c.outputs():
        blocks = [f"blocks.{i}" for i in range(s.layers)] + [f"mtp.{k}.block" for k in range(1, s.mtp_depth + 1)]
        for block in blocks:
            for kind in ("attn", "ffn"):
                for role in c.constant_roles():
                    out.add(connection_name(f"{kind}.{role}").replace("blocks.{i}", block))
    return out


def expected_parameters(spec, where="spec"):
    """Every parameter tensor the model of `spec` has, name -> shape, as widen
    writes them (docs/checkpoints.md), main model first, then the MTP modules.
    Checks the spec first (check_spec)."""
    s = spec if isinstance(spec, SpecSizes) else check_spec(spec, where)
    c = s.design
    out = {}
    for role, tmpl in TENSOR_NAMES["backbone"].items():
        if "{i}" in tmpl:
            continue
        if role == "unembed" and s.tied:
            continue
        if role == "embed" and c is not None:
            continue  # a design's embedding is among its own tensors, below
        out[tmpl] = _backbone_shape(role, s)
    for i in range(s.layers):
        out.update(_block_tensors(s, f"blocks.{i}"))
    if c is not None and c.history is not None:
        out.update(history_tensors(c, 2 * s.layers))
    if c is not None:
        out.update(_design_global_tensors(c, s))
    # MTP modules (docs/checkpoints.md, "MTP modules"): a block and norms each, on the
    # scheme's state layout (s, d_s); the embedding, head, permutation table and exit
    # weights (reduce.w, collapse.readout) are the trunk's.
    if c is not None:
        slots, width = c.s, c.ds
    else:
        slots, width = (1, s.d) if s.scheme == "Residual" else (s.n, s.d)
    for k in range(1, s.mtp_depth + 1):
        out[f"mtp.{k}.hidden_norm"] = [slots, width]
        out[f"mtp.{k}.emb_norm"] = [slots, width]
        out[f"mtp.{k}.mix"] = [2 * width, width]
        out.update(_block_tensors(s, f"mtp.{k}.block"))
        if c is not None and c.history is not None:
            out.update(history_tensors(c, 2, module=k))
        if c is not None and c.collapse == "Reduce" and c.reduce_norm == "GroupNorm":
            out[f"mtp.{k}.reduce.norm"] = [c.width()]
            out[f"mtp.{k}.reduce.norm_bias"] = [c.width()]
        out[f"mtp.{k}.final_norm"] = [s.d]
    return out


# ---- a checkpoint file: header, metadata, spec and tensors together ----

# The suffixes of optimizer state: `opt.<param>.<suffix>` (docs/checkpoints.md, "Optimizer state").
_OPT_SUFFIXES = ("m", "v", "momentum")


def _names(items, limit=4):
    shown = ", ".join(f"`{name}` {list(shape)}" for name, shape in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_checkpoint(path):
    """(spec dict, SpecSizes, tensor entries by name, metadata) of a widen checkpoint,
    after checking all of it before any tensor is decoded: the safetensors header
    (read_header), the metadata (`format`, `format_version`, `spec_json`), the spec's
    fields (check_spec), and the tensors against the parameters the spec implies
    (expected_parameters): each present with the implied shape and dtype F32, none
    other, and optimizer state `opt.<param>.{m,v,momentum}` only for those
    parameters and in their shapes. Needs only the standard library.

    Raises CheckpointError (a ValueError) naming the file and what is wrong;
    NotImplementedError for a configuration this loader does not build."""
    entries, meta, _ = read_header(path)
    if meta.get("format") != "widen-checkpoint":
        raise CheckpointError(
            f"{path}: not a widen checkpoint (header `format` is {_show(meta.get('format'))}, not \"widen-checkpoint\")"
        )
    if meta.get("format_version") != "1":
        raise CheckpointError(
            f"{path}: header `format_version` is {_show(meta.get('format_version'))}; this loader reads version \"1\""
        )
    if "spec_json" not in meta:
        raise CheckpointError(
            f"{path}: no `spec_json` in the header (written by an older widen); re-save it with widen"
        )
    spec = _strict_json(path, "header `spec_json`", meta["spec_json"])
    sizes = check_spec(spec, f"{path}: header `spec_json`")
    expected = expected_parameters(sizes)
    params = {n: e for n, e in entries.items() if not n.startswith("opt.")}
    spec_says = f"the spec says {sizes.summary()}"
    missing = [(n, shape) for n, shape in expected.items() if n not in params]
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} tensor(s) the spec implies are missing: {_names(missing)}; {spec_says}"
        )
    extra = sorted((n, e.shape) for n, e in params.items() if n not in expected)
    if extra:
        raise CheckpointError(
            f"{path}: {len(extra)} tensor(s) are no parameter of the model the spec describes: {_names(extra)}; "
            f"{spec_says}"
        )
    for name, shape in expected.items():
        e = params[name]
        if list(e.shape) != shape:
            raise CheckpointError(
                f"{path}: tensor `{name}` has shape {list(e.shape)}; the spec implies {shape} ({spec_says})"
            )
    for name, e in entries.items():
        if e.dtype != "F32":
            raise CheckpointError(f"{path}: tensor `{name}` has dtype {e.dtype}; widen checkpoints hold F32 tensors")
    for name, e in entries.items():
        if not name.startswith("opt."):
            continue
        param, _, suffix = name[len("opt.") :].rpartition(".")
        if param not in expected or suffix not in _OPT_SUFFIXES:
            raise CheckpointError(
                f"{path}: tensor `{name}` is no optimizer state of this model: optimizer tensors are "
                f"opt.<parameter>.{{{','.join(_OPT_SUFFIXES)}}} for a parameter the spec implies"
            )
        if list(e.shape) != expected[param]:
            raise CheckpointError(
                f"{path}: tensor `{name}` has shape {list(e.shape)}; as state of `{param}` it must have its "
                f"shape {expected[param]}"
            )
    return spec, sizes, entries, meta


def read_checkpoint(path):
    """(spec as a dict, parameter arrays by name, metadata) of a widen checkpoint,
    after check_checkpoint. The spec is the header's `spec_json` (written since data
    identities were recorded); optimizer state (`opt.*`) is not decoded. Needs numpy;
    refuses a parameter holding NaN or an infinity."""
    spec, _, entries, meta = check_checkpoint(path)
    names = [n for n in entries if not n.startswith("opt.")]
    params, _ = read_safetensors(path, names)
    # As widen's reader (runtime/src/checkpoint.rs): a NaN or infinite weight would
    # only show as a NaN loss, so the first such tensor by name is refused.
    for name in sorted(params):
        bad = ~np.isfinite(params[name])
        if bad.any():
            value = params[name][bad].flat[0]
            raise CheckpointError(
                f"{path}: tensor `{name}` holds a non-finite value ({value}); a checkpoint's weights must be finite "
                "(widen neither writes nor reads such a file: the run that wrote it diverged)"
            )
    return spec, params, meta


# ---- ops, exactly as the reference executor (ir/src/exec) computes them ----


def rms_norm(x, gain, eps):
    """x (mean x^2 + eps)^-1/2 [* gain] over the last axis (docs/math.md §1.3)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain


def group_norm(x, groups, gain, bias, eps):
    """(x - mean) (var + eps)^-1/2 over `groups` equal slices of the last axis, then gain, bias."""
    shape = x.shape
    g = x.reshape(*shape[:-1], groups, shape[-1] // groups)
    mu = g.mean(-1, keepdim=True)
    var = (g - mu).pow(2).mean(-1, keepdim=True)
    y = ((g - mu) * torch.rsqrt(var + eps)).reshape(shape)
    return y * gain + bias


def norm_project(x, w, eps, centered):
    """NormProject (docs/math.md §4.3, §6.2): the projection of the normalized x by w
    [K, M]; the first `centered` columns with LayerNorm statistics, the rest RMSNorm."""
    out = x @ w
    if centered > 0:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        head = torch.rsqrt(var + eps) * (out[..., :centered] - w[:, :centered].sum(0) * mu)
        tail = out[..., centered:] * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return torch.cat([head, tail], -1)
    return out * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def sinkhorn(x, iters, eps):
    """Sinkhorn-Knopp over the last two axes (docs/math.md §4.2): exp(x - colmax), then
    `iters` times columns / (sum + eps), rows / (sum + eps)."""
    # The column max cancels in the first column normalization, so it carries no gradient.
    m = torch.exp(x - x.max(-2, keepdim=True).values.detach())
    for _ in range(iters):
        m = m / (m.sum(-2, keepdim=True) + eps)
        m = m / (m.sum(-1, keepdim=True) + eps)
    return m


def elementwise(name, fields, x):
    """The elementwise constraints (docs/math.md §12.1): scale · σ(x) + offset, or tanh(x);
    any other leaves x as it is."""
    if name == "Sigmoid":
        return fields["scale"] * torch.sigmoid(x) + fields["offset"]
    if name == "Tanh":
        return torch.tanh(x)
    return x


def _constrained(name, fields, logits, dims, table):
    """A coefficient's matrix of shape `dims` from its logits (docs/math.md §12.1, as
    Connection::constrain): Permutations is softmax(logits) @ table() (the [s!, s²]
    permutation table); any other constraint applies elementwise, then the logits are
    reshaped to the matrix, then Softmax (per row) or Sinkhorn applies."""
    if name == "Permutations":
        return (torch.softmax(logits, -1) @ table()).reshape(dims)
    if name == "Kronecker":
        return kronecker_carry(logits).reshape(dims)
    x = elementwise(name, fields, logits).reshape(dims)
    if name == "Softmax":
        return torch.softmax(x, -1)
    if name == "Sinkhorn":
        return sinkhorn(x, fields["iters"], fields["eps"])
    return x


def kronecker_factors(s):
    """K for a `Kronecker` carry over s = 2^K streams, or 0 when s is no such power."""
    return s.bit_length() - 1 if s >= 2 and s & (s - 1) == 0 else 0


def kronecker_carry(logits):
    """U_1 ⊗ ... ⊗ U_K from logits [..., 2K] (docs/math.md §12.6): (p_k, 1 - p_k) is the
    softmax of pair k, U_k = [[p_k, 1 - p_k], [1 - p_k, p_k]]; returns [..., s, s]. Built
    by explicit Kronecker products, not widen's table."""
    lead, k = logits.shape[:-1], logits.shape[-1] // 2
    p = torch.softmax(logits.reshape(*lead, k, 2), -1)
    h = None
    for f in range(k):
        same, other = p[..., f, 0], p[..., f, 1]
        u = torch.stack([torch.stack([same, other], -1), torch.stack([other, same], -1)], -2)
        if h is None:
            h = u
        else:
            n = h.shape[-1]
            h = (h[..., :, None, :, None] * u[..., None, :, None, :]).reshape(*lead, 2 * n, 2 * n)
    return h


def kronecker_table(s):
    """widen's constant [2K, s²] table of a `Kronecker` carry (numpy, float64): for factor f
    (acting on bit K - 1 - f of the slot index), row 2f is 1 where entry (i, j) takes p_f
    (the bits agree) and row 2f + 1 where it takes 1 - p_f (docs/math.md §12.6)."""
    k = kronecker_factors(s)
    out = np.zeros((2 * k, s * s))
    for f in range(k):
        bit = k - 1 - f
        for i in range(s):
            for j in range(s):
                row = 2 * f + (0 if (i >> bit) & 1 == (j >> bit) & 1 else 1)
                out[row, i * s + j] = 1.0
    return out


def permutation_table(s):
    """The [s!, s²] table (numpy, float64) whose row k is permutation matrix P_k,
    output-major, P_k[i, p_k(i)] = 1 for the k-th permutation p_k of 0..s-1 in
    lexicographic order, row 0 the identity (docs/math.md §12.2)."""
    perms = list(itertools.permutations(range(s)))
    out = np.zeros((len(perms), s * s))
    for k, perm in enumerate(perms):
        for i, j in enumerate(perm):
            out[k, i * s + j] = 1.0
    return out


def rope(x, base):
    """Half-split RoPE on x [B, T, H, dh] (docs/math.md §1.3): position = index along T;
    the pair (x_i, x_{i + dh/2}) turns by t * base^(-2i/dh)."""
    t, dh = x.shape[1], x.shape[3]
    half = dh // 2
    i = torch.arange(half, dtype=torch.float64)
    theta = base ** (-2.0 * i / dh)
    phi = torch.arange(t, dtype=torch.float64)[:, None] * theta[None, :]  # [T, half]
    c = torch.cos(phi).to(x.dtype)[None, :, None, :]
    s = torch.sin(phi).to(x.dtype)[None, :, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat([lo * c - hi * s, lo * s + hi * c], -1)


def causal_attention(q, k, v, scale, rope_base):
    """q [B, T, H, dh], k, v [B, T, Hkv, dh] -> [B, T, H, dh]; query head h reads
    key/value head floor(h Hkv / H)."""
    if rope_base is not None:
        q, k = rope(q, rope_base), rope(k, rope_base)
    h, hkv = q.shape[2], k.shape[2]
    group = torch.tensor([i * hkv // h for i in range(h)], device=q.device)
    k, v = k[:, :, group], v[:, :, group]
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    t = q.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, -1)
    return torch.einsum("bhts,bshd->bthd", probs, v)


def causal_depthwise_conv(x, w):
    """g[b, t, c] = sum_{i < kappa, i <= t} w[i, c] x[b, t - i, c] (docs/math.md §6.5)."""
    kappa, t = w.shape[0], x.shape[1]
    # x delayed by i positions (zeros before t = 0), times tap i.
    terms = [w[i] * F.pad(x, (0, 0, i, 0))[:, :t] for i in range(min(kappa, t))]
    return torch.stack(terms, 0).sum(0)


def gram_schmidt(out, ys, eps_rel, eps_abs=1e-20):
    """Modified Gram-Schmidt per token (docs/math.md §6.5): each y_j loses its projection
    on out, then on y_0, ..., y_{j-1} (already orthogonalized), each denominator
    <v, v> + eps_rel <out, out> + eps_abs. out [B, T, C], ys list of [B, T, C]."""
    out_sq = (out * out).sum(-1, keepdim=True)
    guard = eps_rel * out_sq + eps_abs
    done = []
    for g in ys:
        u = g - ((g * out).sum(-1, keepdim=True) / (out_sq + guard)) * out
        for v in done:
            u = u - ((u * v).sum(-1, keepdim=True) / ((v * v).sum(-1, keepdim=True) + guard)) * v
        done.append(u)
    return done


def topk_route(scores, k, fixed):
    """Indices 0..fixed, then the k - fixed highest scores among fixed..N, ascending
    (docs/math.md §6.2; ties to the lowest index). scores [B, T, N] -> long [B, T, k]."""
    b, t, n = scores.shape
    fixed_idx = torch.arange(fixed, device=scores.device).expand(b, t, fixed)
    if k == fixed:
        return fixed_idx
    rest = scores[..., fixed:]
    # A stable descending sort keeps the lower index first among equal scores.
    order = torch.sort(rest, dim=-1, descending=True, stable=True).indices[..., : k - fixed] + fixed
    routed = torch.sort(order, dim=-1).values
    return torch.cat([fixed_idx, routed], -1)


# ---- the model ----


class _WidenModel:
    """A widen model built from a checkpoint's spec and tensors (see the module doc).

    The methods of WidenModel, which is this class on top of torch.nn.Module, made
    when first used so that importing this module does not import torch."""

    def __init__(self, spec, params, dtype=None):
        super().__init__()
        # The spec and tensors are checked before any tensor is allocated; load()
        # has checked the file already, this covers a spec and arrays given directly.
        sizes = check_spec(spec)
        expected = expected_parameters(sizes)
        # MTP modules (mtp.*) do not affect the main head: their tensors are not read.
        self.names = [n for n in expected if not n.startswith("mtp.")]
        missing = [n for n in self.names if n not in params]
        extra = sorted(n for n in params if n not in expected)
        given = {n: list(params[n].shape) for n in self.names if n in params}
        wrong = [(n, shape, expected[n]) for n, shape in given.items() if shape != expected[n]]
        if missing or extra or wrong:
            raise CheckpointError(
                f"the tensors do not match the model the spec describes ({sizes.summary()}): missing {missing[:8]}, "
                f"unexpected {extra[:8]}, shapes (name, given, implied) {wrong[:8]}"
            )
        dtype = torch.float64 if dtype is None else dtype
        self.spec = spec
        self.sizes = sizes
        self.dtype = dtype
        self.scheme, self.cfg = sizes.scheme, sizes.cfg
        self.d = sizes.d
        self.layers = sizes.layers
        self.heads = sizes.heads
        self.kv_heads = sizes.kv_heads
        self.head_dim = sizes.head_dim
        self.eps = sizes.norm_eps
        par, mup = _variant(spec["parametrization"])
        self.width_mult = self.d / mup["base_width"] if par == "MuP" else 1.0
        self.mup = mup if par == "MuP" else None
        self.design = sizes.design
        # The carries' tables are constants (never optimized, widen's gradient of them is
        # zero); a file whose table is not widen's would compute another carry.
        for role, build, what in (
            (
                "permutations",
                permutation_table,
                lambda s: f"the table of the {math.factorial(s)} permutation matrices of {s} streams "
                "(row k = P_k, output-major, lexicographic from the identity)",
            ),
            (
                "kronecker",
                kronecker_table,
                lambda s: f"the factor table of a Kronecker carry over {s} streams "
                "(rows 2k and 2k + 1: where factor k puts p_k and 1 - p_k)",
            ),
        ):
            table = connection_name(role)
            if table not in self.names:
                continue
            s = self.design.s
            if not np.array_equal(np.asarray(params[table], dtype=np.float64), build(s)):
                raise CheckpointError(f"tensor `{table}` is not {what(s)}")
        # The constants (the table, `learned: false` static parts) take no gradient, as in widen.
        constants = constant_parameters(sizes)
        self.params = torch.nn.ParameterDict(
            {
                n.replace(".", "__"): torch.nn.Parameter(
                    torch.tensor(params[n], dtype=dtype), requires_grad=n not in constants
                )
                for n in self.names
            }
        )

    # -- configuration --

    def _p(self, name):
        return self.params[name.replace(".", "__")]

    def _name(self, group, role, **kw):
        return TENSOR_NAMES[group][role].format(**kw)

    def _xhc_augmented(self, kind):
        x = self.cfg
        return len(x["conv_kernels"]) > 0 and (kind == "ffn" or x["temporal_aug"] == "MlpAndAttention")

    # -- backbone (docs/math.md §1.3) --

    def attention(self, u, i):
        b, t, _ = u.shape
        h, hkv, dh = self.heads, self.kv_heads, self.head_dim
        name = lambda r: self._p(self._name("backbone", "attn." + r, i=i))
        a = rms_norm(u, name("norm"), self.eps)
        q = (a @ name("wq")).reshape(b, t, h, dh)
        k = (a @ name("wk")).reshape(b, t, hkv, dh)
        v = (a @ name("wv")).reshape(b, t, hkv, dh)
        scale = self.mup["attn_mult"] / dh if self.mup else 1.0 / math.sqrt(dh)
        o = causal_attention(q, k, v, scale, self.spec["rope_base"])
        return o.reshape(b, t, h * dh) @ name("wo")

    def ffn(self, u, i):
        name = lambda r: self._p(self._name("backbone", "ffn." + r, i=i))
        x = rms_norm(u, name("norm"), self.eps)
        return (F.silu(x @ name("w1")) * (x @ name("w3"))) @ name("w2")

    def branch(self, kind, u, i):
        return self.attention(u, i) if kind == "attn" else self.ffn(u, i)

    # -- schemes --

    def embed(self, ids):
        b, t = ids.shape
        c = self.design
        if c is not None and c.create == "Full":
            return self._p(connection_name("embed_wide"))[ids].reshape(b, t, c.s, c.ds)
        h = self._p("embed")[ids]  # [B, T, D]
        if self.scheme == "Residual":
            return h[:, :, None, :]
        if c is None:  # xHC
            return h[:, :, None, :].expand(-1, -1, self.cfg["n"], -1)
        if c.create == "Replicate":
            return h[:, :, None, :].expand(-1, -1, c.s, -1)
        if c.create == "Expand":
            h = h @ self._p(connection_name("embed_expand"))
        return h.reshape(b, t, c.s, c.ds)  # Split, or the expanded embedding

    def sublayer(self, state, kind, i):
        """Block i's attention (`kind` "attn", sublayer 2i) or FFN ("ffn", sublayer 2i + 1)."""
        if self.scheme == "Residual":
            u = state[:, :, 0, :]
            return state + self.branch(kind, u, i)[:, :, None, :]
        if self.design is not None:
            return self._connection(state, kind, i)
        return self._xhc(state, kind, i)

    def _connection(self, H, kind, i):
        """One sublayer of a connection-language design (docs/math.md §0.3, §12.1), as
        ir/src/lower/schemes/connection.rs lowers it: the state H [B, T, s, d_s];
        X = Read H [m, d_s], z = F(vec X) reshaped [m, d_s], H' = Carry H + Write z
        (Carry and Write per slot with form PerSlot), each coefficient
        constraint(static + dynamic)."""
        c = self.design
        b, t, _, ds = H.shape
        p = lambda role: self._p(connection_name(f"{kind}.{role}").format(i=i))  # noqa: E731
        if c.generator == "Flat":
            read, carry, write = self._flat_mixing(H, p)
        else:
            read, carry, write = p("h_pre"), p("h_res"), p("h_post")
            lead = ()
            if c.generator == "PerSlot":
                read, carry, write = self._per_slot_mixing(H, p, read, carry, write)
                lead = (b, t)
            read = self._constrain("read", read, lead)
            carry = self._constrain("carry", carry, lead)
            write = self._constrain("write", write, lead)
        x = torch.matmul(read, H)  # [B, T, m, d_s]
        z = self.branch(kind, x.reshape(b, t, c.m * ds), i).reshape(b, t, c.m, ds)
        carried = torch.matmul(carry, H) if c.carry.form == "Matrix" else H * carry
        written = torch.matmul(write, z) if c.write.form == "Matrix" else z * write
        return carried + written

    def _per_slot_mixing(self, H, p, read, carry, write):
        """static + gate ⊙ act(norm(H_i) [W_alpha | W_beta] / τ), per slot i (docs/math.md
        §2.3, §3, §5.5): row i of the projection is slot i's read (m), carry (s, or 1 per
        slot) and write weights; read and a full carry are transposed to output-major."""
        c, g = self.design, self.design.gen
        m = c.m
        carry_cols = c.matrix_shape("carry")[1]
        if g["norm"] == "LayerNorm":
            normed = group_norm(H, 1, p("norm"), p("norm_bias"), self.eps)
        else:
            normed = rms_norm(H, p("norm"), self.eps)
        coef = (normed @ torch.cat([p("w_alpha"), p("w_beta")], 1)) / self._tau()
        if g["act"] == "Tanh":
            coef = torch.tanh(coef)
        d_read = coef[..., :m].transpose(-1, -2)  # [B, T, m, s]
        d_carry = coef[..., m : m + carry_cols]
        if c.carry.form == "Matrix":
            d_carry = d_carry.transpose(-1, -2)  # [B, T, s, s]
        d_write = coef[..., m + carry_cols :]  # [B, T, s, m] or [B, T, s, 1]
        if g["gate"] == "Paired":
            gates = p("s_alpha"), p("s_alpha"), p("s_beta")
        else:
            gates = p("s_pre"), p("s_res"), p("s_post")
        return d_read * gates[0] + read, d_carry * gates[1] + carry, d_write * gates[2] + write

    def _tau(self):
        """The temperature applied, τ_eff: τ (default √(D/m)); under muP τ(D_base) · D/D_base
        (docs/math.md §8.1 DECISION)."""
        c = self.design
        tau = lambda d: c.gen["temperature"] if c.gen["temperature"] is not None else math.sqrt(d // c.m)  # noqa: E731
        if self.mup is None:
            return tau(self.d)
        return tau(self.mup["base_width"]) * self.width_mult

    def _flat_mixing(self, H, p):
        """constraint(α ⊙ (RMSNorm(vec H) φ) + b), columns [read | write | carry]
        (docs/math.md §4.3, §12.1); muP divides α by D/D_base."""
        c = self.design
        b, t = H.shape[:2]
        flat = H.reshape(b, t, c.width())
        if c.gen["gain"]:
            raw = rms_norm(flat, p("norm"), self.eps) @ p("phi")
        else:
            raw = norm_project(flat, p("phi"), self.eps, 0)
        sizes = [c.logits("read"), c.logits("write"), c.logits("carry")]
        alpha = p("alpha")
        scale = torch.cat([alpha[j : j + 1].expand(n) for j, n in enumerate(sizes)]) / self.width_mult
        logits = raw * scale + p("bias")
        read, write, carry = torch.split(logits, sizes, -1)
        return (
            self._constrain("read", read, (b, t)),
            self._constrain("carry", carry, (b, t)),
            self._constrain("write", write, (b, t)),
        )

    def _constrain(self, which, logits, lead):
        """A coefficient's matrix [*lead, rows, cols] from its logits (docs/math.md §12.1):
        Permutations as softmax(logits) times the permutation table; else the elementwise
        constraint, the reshape to the matrix, then a row-wise one (Softmax, Sinkhorn)."""
        c = self.design
        dims = (*lead, *c.matrix_shape(which))
        name, f = c.coefficient(which).constraint
        return _constrained(name, f, logits, dims, lambda: self._p(connection_name("permutations")))

    def _xhc(self, X, kind, i):
        """One full-xHC sublayer (docs/math.md §6.2-6.6), as ir/src/lower/schemes/xhc.rs."""
        x = self.cfg
        n, k, fixed = x["n"], x["k"], x["fixed"]
        b, t, _, c = X.shape
        p = lambda r: self._p(self._name("xhc", f"{kind}.{r}", i=i))
        w = self.width_mult
        routed = fixed < k
        # Routing pass: one NormProject over [W^r | W^pre], router columns mean-centred.
        ws = ([p("router")] if routed else []) + [p("pre")]
        proj = norm_project(X.reshape(b, t, n * c), torch.cat(ws, 1), self.eps, n if routed else 0)
        off = n if routed else 0
        pre = torch.sigmoid(proj[..., off : off + n] * (p("alpha_pre") / w) + p("b_pre"))  # [B, T, N]
        if routed:
            r = proj[..., :n] / w
            scores = torch.sigmoid(r) if x["router"] == "Sigmoid" else torch.softmax(r, -1)
            idx = topk_route(scores.detach(), k, fixed)
            gates = torch.gather(scores, 2, idx[..., fixed:])
            pgate = torch.cat([torch.ones(b, t, fixed, dtype=X.dtype, device=X.device), gates], -1)[..., None]
        else:
            idx = torch.arange(k, device=X.device).expand(b, t, k)
            pgate = None
        u = torch.einsum("btj,btjc->btc", pre, X)  # dense read
        x_act = torch.gather(X, 2, idx[..., None].expand(b, t, k, c))  # [B, T, k, C]
        # Active-set maps: one NormProject over [W^res | W^post] (RMS statistics).
        aug = self._xhc_augmented(kind)
        kr = len(x["conv_kernels"]) + 1 if aug else 1
        proj2 = norm_project(x_act.reshape(b, t, k * c), torch.cat([p("res"), p("post")], 1), self.eps, 0)
        h = (proj2[..., : k * k] * (p("alpha_res") / w)).reshape(b, t, k, k) + p("b_res")
        h_res = sinkhorn(h, x["sinkhorn_iters"], 0.0)
        if x["row_clamp"]:
            h_res = h_res / torch.clamp(h_res.sum(-1, keepdim=True), min=1.0)
        hp = (proj2[..., k * k : k * k + k * kr] * (p("alpha_post") / w)).reshape(b, t, k, kr) + p("b_post")
        post = 2.0 * torch.sigmoid(hp)
        if pgate is not None:
            post = post * pgate
        # The branch output and its temporal components Y [B, T, K_r, C].
        out = self.branch(kind, u, i)
        ys = [out]
        if aug:
            convs = [
                causal_depthwise_conv(out, self._p(XHC_CONV_NAMES[kind].format(i=i, j=j)))
                for j in range(len(x["conv_kernels"]))
            ]
            gs = x["gram_schmidt"]
            if gs is None:
                gs = _variant(self.spec["train"]["optimizer"])[0] != "Muon"
            ys += gram_schmidt(out, convs, x["gs_eps"]) if gs else convs
        Y = torch.stack(ys, 2)
        x_new = torch.matmul(h_res, x_act) + torch.matmul(post, Y)
        return X.scatter(2, idx[..., None].expand(b, t, k, c), x_new)

    def collapse(self, state):
        """The state [B, T, s, d_s] as one [B, T, D] vector before the final norm (docs/math.md §0.3)."""
        c = self.design
        if self.scheme == "Residual":
            return state[:, :, 0, :]
        if c is None or c.collapse == "Sum":  # xHC sums its streams
            return state.sum(2)
        b, t = state.shape[:2]
        if c.collapse == "Mean":
            return state.mean(2)
        if c.collapse == "Concat":
            return state.reshape(b, t, self.d)
        if c.collapse == "Reduce":
            # VWN's GroupNorm with groups of size D, then x @ W_reduce (docs/math.md §5.2, §5.6).
            flat = state.reshape(b, t, c.width())
            if c.reduce_norm == "GroupNorm":
                gain, bias = self._p(connection_name("reduce.norm")), self._p(connection_name("reduce.norm_bias"))
                flat = group_norm(flat, c.s // c.m, gain, bias, self.eps)
            return flat @ self._p(connection_name("reduce.w"))
        # Readout: Σ_i c_i X_i with c = constraint(w) [1, s] (docs/math.md §12.3).
        name, fields = c.readout.constraint
        w = self._p(connection_name("collapse.readout"))
        weights = torch.softmax(w, -1) if name == "Softmax" else elementwise(name, fields, w)
        return torch.matmul(weights, state).reshape(b, t, self.d)

    def _depth_read(self, prefix, values):
        """Σ_i a_i v_i over the history values [B, T, s, d_s] (docs/math.md §12.5), as
        DepthHistory::read: with attention weights a = softmax_i(RMSNorm(vec v_i) · (g ⊙ w))
        (the gain g folded into the query w, the logits / (D/D_base) under muP); with
        static ones a = the read's weights."""
        b, t, slots, ds = values[0].shape
        width = slots * ds
        if self.design.history.static:
            alpha = self._p(f"{prefix}.weights")
            weights = [alpha[i] for i in range(len(values))]
        else:
            q = (self._p(f"{prefix}.norm") * self._p(f"{prefix}.query")).reshape(width, 1)
            logits = torch.cat([rms_norm(v.reshape(b, t, width), None, self.eps) @ q for v in values], 2)
            a = torch.softmax(logits / self.width_mult, -1)  # [B, T, n]
            weights = [a[:, :, i, None, None] for i in range(len(values))]
        out = values[0] * weights[0]
        for v, w in zip(values[1:], weights[1:]):
            out = out + v * w
        return out

    def _history_trunk(self, state):
        """The trunk with a depth history (docs/math.md §12.5), as
        ir/src/lower/schemes/history.rs lowers it, from the created state [B, T, s, d_s]
        (entry 0) to the [B, T, D] vector before the final norm. Outputs: each sublayer
        l reads the finished entries and the current block's partial sum, its output
        joins the partial sum, which becomes an entry after every `block` sublayers; the
        head reads them all. States: the fixed state's sublayers; after every `block`
        the state is an entry, and where the period divides its index i the state
        becomes the read of the entries j ≡ i (mod dilation); then the fixed collapse."""
        h = self.design.history
        b, t = state.shape[:2]
        entries, partial = [state], None
        reads = dict(h.reads(2 * self.layers))
        for l in range(2 * self.layers):
            kind, i = ("attn", "ffn")[l % 2], l // 2
            prefix = f"{_sublayer_prefix(l)}.history"
            if h.entries == "Outputs":
                values = entries + ([] if partial is None else [partial])
                u = self._depth_read(prefix, values)
                y = self.branch(kind, u.reshape(b, t, self.d), i).reshape(u.shape)
                partial = y if partial is None else partial + y
                if (l + 1) % h.block == 0:
                    entries.append(partial)
                    partial = None
                continue
            state = self.sublayer(state, kind, i)
            if (l + 1) % h.block == 0:
                entries.append(state)
            if l in reads:
                state = self._depth_read(prefix, [entries[j] for j in reads[l]])
        if h.entries == "States":
            return self.collapse(state)
        values = entries + ([] if partial is None else [partial])
        return self._depth_read("history", values).reshape(b, t, self.d)

    def forward(self, ids):
        """Main-head logits [B, T, V] of token ids [B, T]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        state = self.embed(ids).to(self.dtype)
        if self.design is not None and self.design.history is not None:
            collapsed = self._history_trunk(state)
        else:
            for i in range(self.layers):
                state = self.sublayer(state, "attn", i)
                state = self.sublayer(state, "ffn", i)
            collapsed = self.collapse(state)
        h = rms_norm(collapsed, self._p("final_norm"), self.eps)
        if self.spec["tie_embeddings"]:
            full = self.design is not None and self.design.create == "Full"
            table = self._p(connection_name("embed_wide") if full else "embed")
            logits = h @ table.T
        else:
            logits = h @ self._p("unembed")
        if self.mup is not None:
            logits = logits * (self.mup["output_mult"] / self.width_mult)
        return logits

    def loss(self, tokens):
        """Mean next-token cross-entropy (nats) of windows tokens [B, T + 1]."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        logits = self.forward(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def named_checkpoint_parameters(self):
        """(checkpoint name, parameter) pairs, for comparing gradients by name."""
        return [(n, self._p(n)) for n in self.names]


def _model_class():
    """WidenModel: _WidenModel on top of torch.nn.Module (imports torch)."""
    cls = globals().get("_WIDEN_MODEL")
    if cls is None:
        cls = type("WidenModel", (_WidenModel, torch.nn.Module), {"__module__": __name__, "__doc__": _WidenModel.__doc__})
        globals()["_WIDEN_MODEL"] = cls
    return cls


def __getattr__(name):
    # WidenModel is made on first use (PEP 562), so that `import widen_torch` and the
    # checks above need no torch.
    if name == "WidenModel":
        return _model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(path, dtype=None):
    """The WidenModel of a checkpoint file (float64 unless `dtype` says otherwise),
    after check_checkpoint has checked all of it."""
    spec, params, _ = read_checkpoint(path)
    return _model_class()(spec, params, dtype=dtype)
