"""Codecs: batched compression of blobs, and the registry that names them.

A codec spec is a short string stored in the manifest and accepted by every API that takes a
codec: ``"zstd"`` (level 3), ``"zstd:9"``, ``"zstd:-5"`` (fast), ``"lz4"``, ``"raw"``;
case-insensitive. ``get_codec(codec.name)`` gives back an equal codec. The format name
``"nvcomp"`` is reserved for the GPU module ``tiered.codecs.nvcomp`` (loaded on demand when it
exists); it decodes the same ``"zstd"`` bytes.

Format ids (stored in the blob index and the manifest): 0 raw, 1 zstd, 2 lz4.

Example:
    >>> import numpy as np
    >>> from tiered.codecs import get_codec
    >>> codec = get_codec("ZSTD:9")
    >>> codec.name, get_codec(codec.name) == codec
    ('zstd:9', True)
    >>> enc = codec.encode(np.zeros(100, np.uint8), np.array([0]), np.array([100]))
    >>> out = np.empty(100, np.uint8)
    >>> codec.decode(enc.data, enc.offsets, enc.sizes, out, np.array([0]), np.array([100]))
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import UnknownCodecError
from .base import Codec, EncodedBatch
from .checksum import segment_checksums, segment_checksums_torch, verify

if TYPE_CHECKING:
    from .lz4 import Lz4Codec
    from .raw import RawCodec
    from .zstd import ZstdCodec

# The codec classes load on first use (PEP 562): their modules import the byte-copy engine, which
# imports torch, and `tiered verify` (checksums of stored bytes only) must not wait for torch.
_LAZY = {"RawCodec": "raw", "Lz4Codec": "lz4", "ZstdCodec": "zstd"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "Codec",
    "EncodedBatch",
    "ZstdCodec",
    "Lz4Codec",
    "RawCodec",
    "get_codec",
    "register_codec",
    "available_codecs",
    "codec_for_format_id",
    "segment_checksums",
    "segment_checksums_torch",
    "verify",
]

#: Factory signature: ``factory(argument)`` where ``argument`` is the text after ``":"`` in the
#: spec, or None (``"zstd:9"`` -> ``"9"``, ``"lz4"`` -> None).
CodecFactory = Callable[[str | None], Codec]

_RESERVED = {"nvcomp": "tiered.codecs.nvcomp"}
_FORMAT_IDS = {0: "raw", 1: "zstd", 2: "lz4"}
_lock = threading.Lock()


def _zstd_factory(arg: str | None) -> Codec:
    if arg is None:
        return __getattr__("ZstdCodec")()
    try:
        level = int(arg.strip())
    except ValueError:
        raise UnknownCodecError(
            f"zstd level must be an integer, got {arg!r}; write e.g. 'zstd:3' or 'zstd:-5'"
        ) from None
    return __getattr__("ZstdCodec")(level)


def _no_argument(name: str, class_name: str) -> CodecFactory:
    def factory(arg: str | None) -> Codec:
        if arg is not None:
            raise UnknownCodecError(f"codec {name!r} takes no argument, got {name}:{arg}; write {name!r}")
        return __getattr__(class_name)()

    return factory


_FACTORIES: dict[str, CodecFactory] = {
    "raw": _no_argument("raw", "RawCodec"),
    "lz4": _no_argument("lz4", "Lz4Codec"),
    "zstd": _zstd_factory,
}


def _known() -> str:
    return ", ".join("zstd[:level] (e.g. 'zstd:9')" if name == "zstd" else name for name in _FACTORIES)


def _unknown(spec: object) -> UnknownCodecError:
    return UnknownCodecError(
        f"unknown codec {spec!r}; known codecs: {_known()}; "
        "for GPU decode the same 'zstd' bytes are read by nvCOMP"
    )


def register_codec(format_name: str, factory: CodecFactory) -> None:
    """Make ``get_codec("<format_name>[:arg]")`` build a codec with ``factory(arg)``.

    Args:
        format_name: Lower-case name without ``":"`` (e.g. ``"nvcomp"``); replaces an earlier
            registration of the same name.
        factory: Called with the text after ``":"`` (or None); returns a :class:`Codec` whose
            ``name`` resolves back to an equal codec.

    Example:
        >>> from tiered.codecs import RawCodec, register_codec, get_codec
        >>> register_codec("copy", lambda arg: RawCodec())
        >>> get_codec("copy").format
        'raw'
    """
    key = format_name.strip().lower()
    if not key or ":" in key:
        raise ValueError(f"format_name must be a non-empty name without ':', got {format_name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    with _lock:
        _FACTORIES[key] = factory


def available_codecs() -> list[str]:
    """Names of the registered codec formats whose dependencies are importable.

    Example:
        >>> from tiered.codecs import available_codecs
        >>> "zstd" in available_codecs()
        True
    """
    names = []
    for name in list(_FACTORIES):
        try:
            _FACTORIES[name](None)
        except ImportError:
            continue
        except Exception:
            # A factory that needs an argument is still available.
            pass
        names.append(name)
    for name, module_name in _RESERVED.items():
        if name in names:
            continue
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
            _load_reserved(name, name)(None)
        except Exception:
            # Listing must not fail because an optional GPU module cannot start here.
            continue
        names.append(name)
    return names


def get_codec(spec: str | Codec) -> Codec:
    """Resolve a codec spec (or pass a :class:`Codec` through).

    Args:
        spec: ``"zstd"``, ``"zstd:<level>"``, ``"lz4"``, ``"raw"`` (case-insensitive), a name
            registered with :func:`register_codec`, ``"nvcomp[...]"`` when
            ``tiered.codecs.nvcomp`` is installed, or a codec instance.

    Returns:
        The codec.

    Raises:
        UnknownCodecError: the spec names no known codec or has a bad argument (the message
            lists the known codecs).
        CodecUnavailableError: the codec's package is not installed (the message names the
            install command).

    Example:
        >>> from tiered.codecs import get_codec
        >>> get_codec("zstd").name, get_codec("Zstd:-5").level, get_codec("lz4").format_id
        ('zstd:3', -5, 2)
    """
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise UnknownCodecError(
            f"a codec spec must be a string or a Codec, got {type(spec).__name__}; known codecs: {_known()}"
        )
    text = spec.strip().lower()
    name, sep, arg = text.partition(":")
    name = name.strip()
    factory = _FACTORIES.get(name)
    if factory is None and name in _RESERVED:
        factory = _load_reserved(name, spec)
    if factory is None:
        raise _unknown(spec)
    return factory(arg if sep else None)


def _load_reserved(name: str, spec: str) -> CodecFactory:
    """Import the module owning a reserved format name; it registers its factory on import."""
    module_name = _RESERVED[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise UnknownCodecError(
            f"codec {spec!r} needs the GPU module {module_name}, which this installation does not have; "
            f"known codecs: {_known()}; for GPU decode the same 'zstd' bytes are read by nvCOMP"
        ) from None
    factory = _FACTORIES.get(name) or getattr(module, "codec_factory", None)
    if factory is None:
        raise UnknownCodecError(
            f"{module_name} did not register the {name!r} codec (expected register_codec({name!r}, ...) "
            "or a module-level codec_factory)"
        )
    return factory


def codec_for_format_id(format_id: int) -> Codec:
    """A codec that decodes blobs of ``format_id`` (as stored in the blob index).

    Args:
        format_id: 0 raw, 1 zstd, 2 lz4.

    Raises:
        UnknownCodecError: the id is not a known format (a newer tiered wrote it, or the index
            is damaged).

    Example:
        >>> from tiered.codecs import codec_for_format_id
        >>> codec_for_format_id(1).name
        'zstd:3'
    """
    name = _FORMAT_IDS.get(int(format_id))
    if name is None:
        raise UnknownCodecError(
            f"unknown codec format id {format_id}; known ids: "
            + ", ".join(f"{i} ({n})" for i, n in sorted(_FORMAT_IDS.items()))
            + "; the store was written by a newer tiered or its index is damaged"
        )
    return get_codec(name)
