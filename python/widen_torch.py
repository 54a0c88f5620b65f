"""Load a widen checkpoint into PyTorch and compute its logits and loss.

Needs only numpy and torch (no widen install). A checkpoint is a safetensors
file; this module parses its header (8-byte little-endian length, then JSON)
and the raw little-endian bytes itself. The file format, every tensor's name,
shape and orientation are documented in docs/checkpoints.md; the equations are
those of docs/math.md, implemented as widen's lowering implements them
(ir/src/lower/).

Supported: the plain residual, mHC (docs/math.md §4), GHC / VWN (§5, dynamic or
static, embed_mode Full or Expand, with or without the GroupNorm before the
reduce) and full xHC (§6, flash: None), with a SwiGLU FFN, f32 precision, the
standard parametrization or muP (§8.1), tied or separate unembedding. With MTP
modules (§7) the main head's logits and next-token loss are computed; the MTP
terms are not. Other configurations (HC, FC, MoE, xHC-Flash, bf16) raise
NotImplementedError.

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
for specs/residual.ron, specs/mhc.ron, specs/vwn-r4.ron and specs/xhc.ron.
"""

import importlib
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
    "mtp.depth": [0, 16, "each module is one more block and head; DeepSeek-V3 uses 1"],
    "parametrization.base_width": [1, 16777216, "it is at most d_model"]
}
# END SPEC_LIMITS

# Most temporal-conv kernels on an xHC sublayer (ir/src/spec/limits.rs, MAX_CONV_KERNELS).
MAX_CONV_KERNELS = 16

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
    scheme, cfg = r.variant(spec, "residual", "residual", ("Residual",), ("Hc", "Fc", "Mhc", "Ghc", "Xhc"))
    s.scheme, s.cfg = scheme, cfg
    s.n = s.m = s.k = s.fixed = None
    s.kernels = []
    if scheme == "Mhc":
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
    # Valid, but not built here.
    if scheme not in ("Residual", "Mhc", "Ghc", "Xhc"):
        raise NotImplementedError(f"{where}: residual scheme {scheme}: this loader builds Residual, Mhc, Ghc and Xhc")
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


def _conn_shape(scheme, role, s):
    """The shape of a connection tensor (docs/checkpoints.md, one table per scheme)."""
    sub, _, kind = role.partition(".")
    n, m, k, d = s.n, s.m, s.k, s.d
    if scheme == "Mhc":
        return {"phi": [n * d, n * n + 2 * n], "alpha": [3], "bias": [n * n + 2 * n]}[kind]
    if scheme == "Ghc":
        db = d // m
        wide = n * db
        return {
            "embed_wide": [s.vocab, wide],
            "h_pre": [m, n],
            "h_res": [n, n],
            "h_post": [n, m],
            "norm": [db] if sub != "reduce" else [wide],
            "w_alpha": [db, m + n],
            "w_beta": [db, m],
            "s_pre": [m, n],
            "s_res": [n, n],
            "s_post": [n, m],
            "norm_bias": [wide],
            "w": [wide, d],
        }[kind or sub]
    # Xhc: K_r = 1 + len(conv_kernels) on augmented sublayers.
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
    if s.scheme == "Mhc":
        for role, tmpl in TENSOR_NAMES["mhc"].items():
            add(tmpl, lambda role=role: _conn_shape("Mhc", role, s))
    elif s.scheme == "Ghc":
        generator = {"norm", "w_alpha", "w_beta", "s_pre", "s_res", "s_post"}
        for role, tmpl in TENSOR_NAMES["ghc"].items():
            sub, _, kind = role.partition(".")
            if "{i}" not in tmpl or (kind in generator and not s.cfg["dynamic"]):
                continue  # global tensors, or a static GHC's absent generator
            add(tmpl, lambda role=role: _conn_shape("Ghc", role, s))
    elif s.scheme == "Xhc":
        for role, tmpl in TENSOR_NAMES["xhc"].items():
            sub, _, kind = role.partition(".")
            if kind == "router" and s.fixed >= s.k:
                continue
            if kind == "conv":
                continue  # below, for each augmented sublayer
            add(tmpl, lambda role=role: _conn_shape("Xhc", role, s))
        for sub in ("attn", "ffn"):
            if _xhc_augmented(s, sub):
                add(XHC_CONV_NAMES[sub], None)
    return out


def expected_parameters(spec, where="spec"):
    """Every parameter tensor the model of `spec` has, name -> shape, as widen
    writes them (docs/checkpoints.md), main model first, then the MTP modules.
    Checks the spec first (check_spec)."""
    s = spec if isinstance(spec, SpecSizes) else check_spec(spec, where)
    out = {}
    for role, tmpl in TENSOR_NAMES["backbone"].items():
        if "{i}" in tmpl:
            continue
        if role == "unembed" and s.tied:
            continue
        if role == "embed" and s.scheme == "Ghc":
            continue  # GHC's embedding is embed_wide or embed + embed_expand, below
        out[tmpl] = _backbone_shape(role, s)
    for i in range(s.layers):
        out.update(_block_tensors(s, f"blocks.{i}"))
    if s.scheme == "Ghc":
        wide = s.n * (s.d // s.m)
        if s.cfg["embed_mode"] == "Full":
            out[TENSOR_NAMES["ghc"]["embed_wide"]] = [s.vocab, wide]
        else:
            out[GHC_EXPAND_NAMES["embed"]] = [s.vocab, s.d]
            out[GHC_EXPAND_NAMES["embed_expand"]] = [s.d, wide]
        for role in ("reduce.norm", "reduce.norm_bias", "reduce.w"):
            if role != "reduce.w" and s.reduce_norm != "GroupNorm":
                continue
            out[TENSOR_NAMES["ghc"][role]] = _conn_shape("Ghc", role, s)
    # MTP modules (docs/checkpoints.md, "MTP modules"): a block and norms each; the
    # embedding, head and (GHC) reduce.w are the trunk's.
    slots, width = {
        "Residual": (1, s.d),
        "Mhc": (s.n, s.d),
        "Ghc": (s.n, s.d // s.m if s.m else 0),
        "Xhc": (s.n, s.d),
    }[s.scheme]
    for k in range(1, s.mtp_depth + 1):
        out[f"mtp.{k}.hidden_norm"] = [slots, width]
        out[f"mtp.{k}.emb_norm"] = [slots, width]
        out[f"mtp.{k}.mix"] = [2 * width, width]
        out.update(_block_tensors(s, f"mtp.{k}.block"))
        if s.scheme == "Ghc" and s.reduce_norm == "GroupNorm":
            out[f"mtp.{k}.reduce.norm"] = [s.n * width]
            out[f"mtp.{k}.reduce.norm_bias"] = [s.n * width]
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
        self.params = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.nn.Parameter(torch.tensor(params[n], dtype=dtype)) for n in self.names}
        )

    # -- configuration --

    def _p(self, name):
        return self.params[name.replace(".", "__")]

    def _name(self, group, role, **kw):
        return TENSOR_NAMES[group][role].format(**kw)

    def _ghc_reduce_norm(self):
        return self.sizes.reduce_norm

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
        if self.scheme == "Ghc":
            g = self.cfg
            b, t = ids.shape
            db = self.d // g["m"]
            if g["embed_mode"] == "Full":
                flat = self._p("embed_wide")[ids]
            else:
                flat = self._p("embed")[ids] @ self._p("embed_expand")
            return flat.reshape(b, t, g["n"], db)
        h = self._p("embed")[ids]  # [B, T, D]
        if self.scheme == "Residual":
            return h[:, :, None, :]
        n = self.cfg["n"]
        return h[:, :, None, :].expand(-1, -1, n, -1)

    def sublayer(self, state, kind, i):
        """Block i's attention (`kind` "attn", sublayer 2i) or FFN ("ffn", sublayer 2i + 1)."""
        if self.scheme == "Residual":
            u = state[:, :, 0, :]
            return state + self.branch(kind, u, i)[:, :, None, :]
        if self.scheme == "Mhc":
            return self._mhc(state, kind, i)
        if self.scheme == "Ghc":
            return self._ghc(state, kind, i)
        return self._xhc(state, kind, i)

    def _mhc(self, X, kind, i):
        """docs/math.md §4.3, as ir/src/lower/schemes/mhc.rs."""
        c = self.cfg
        n = c["n"]
        b, t, _, d = X.shape
        p = lambda r: self._p(self._name("mhc", f"{kind}.{r}", i=i))
        raw = norm_project(X.reshape(b, t, n * d), p("phi"), self.eps, 0)
        alpha = p("alpha")
        scale = torch.cat([alpha[0:1].expand(n), alpha[1:2].expand(n), alpha[2:3].expand(n * n)]) / self.width_mult
        logits = raw * scale + p("bias")
        pre = torch.sigmoid(logits[..., :n]) + c["pre_eps"]  # [B, T, n]
        post = c["post_max"] * torch.sigmoid(logits[..., n : 2 * n])  # [B, T, n]
        res = sinkhorn(logits[..., 2 * n :].reshape(b, t, n, n), c["sinkhorn_iters"], c["sinkhorn_eps"])
        u = torch.einsum("btj,btjc->btc", pre, X)
        y = self.branch(kind, u, i)
        return torch.einsum("btij,btjc->btic", res, X) + post[..., None] * y[:, :, None, :]

    def _ghc(self, H, kind, i):
        """docs/math.md §5.3-5.5, as ir/src/lower/schemes/ghc.rs: output-major Read [m, n],
        Carry [n, n], Write [n, m]."""
        g = self.cfg
        m, n = g["m"], g["n"]
        b, t, _, db = H.shape
        p = lambda r: self._p(self._name("ghc", f"{kind}.{r}", i=i))
        read, carry, write = p("h_pre"), p("h_res"), p("h_post")
        if g["dynamic"]:
            normed = rms_norm(H, p("norm"), self.eps)  # per slot, over d_b
            coef = normed @ torch.cat([p("w_alpha"), p("w_beta")], 1)  # [B, T, n, 2m + n]
            coef = torch.tanh(coef / self._ghc_tau())
            read = coef[..., :m].transpose(-1, -2) * p("s_pre") + read  # [B, T, m, n]
            carry = coef[..., m : m + n].transpose(-1, -2) * p("s_res") + carry  # [B, T, n, n]
            write = coef[..., m + n :] * p("s_post") + write  # [B, T, n, m]
        x = torch.matmul(read, H)  # [B, T, m, d_b]
        z = self.branch(kind, x.reshape(b, t, m * db), i).reshape(b, t, m, db)
        return torch.matmul(carry, H) + torch.matmul(write, z)

    def _ghc_tau(self):
        g = self.cfg
        if self.mup is None:
            return g["tau"] if g["tau"] is not None else math.sqrt(self.d // g["m"])
        base = g["tau"] if g["tau"] is not None else math.sqrt(self.mup["base_width"] // g["m"])
        return base * self.width_mult

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
        if self.scheme == "Residual":
            return state[:, :, 0, :]
        if self.scheme == "Ghc":
            g = self.cfg
            b, t, n, db = state.shape
            flat = state.reshape(b, t, n * db)
            if self._ghc_reduce_norm() == "GroupNorm":
                flat = group_norm(flat, n // g["m"], self._p("reduce.norm"), self._p("reduce.norm_bias"), self.eps)
            return flat @ self._p("reduce.w")
        if self.scheme == "Mhc" and self.cfg["collapse"] == "Mean":
            return state.mean(2)
        return state.sum(2)

    def forward(self, ids):
        """Main-head logits [B, T, V] of token ids [B, T]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        state = self.embed(ids).to(self.dtype)
        for i in range(self.layers):
            state = self.sublayer(state, "attn", i)
            state = self.sublayer(state, "ffn", i)
        h = rms_norm(self.collapse(state), self._p("final_norm"), self.eps)
        if self.spec["tie_embeddings"]:
            table = self._p("embed_wide") if self.scheme == "Ghc" and self.cfg["embed_mode"] == "Full" else self._p("embed")
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
