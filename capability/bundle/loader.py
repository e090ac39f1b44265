"""Loading a bundle: metadata, module, verification, weights, warm-up, each stage timed.

    read_metadata  manifest.json; the folder holds exactly its files, and they are a
                   bundle's (config.json, tokenizer.json, a weight file per part);
                   config.json and tokenizer.json read, checked against it and parsed
                   from those bytes
    build_module   encoder + head built on the meta device: shapes only, no memory, no init;
                   a weight file larger than its part can need, by its manifest size, is
                   refused here, unread
    verify         every other listed file read into memory once and its size and SHA-256
                   checked against the manifest; the weight files' bytes are kept
    load_weights   each part parsed from the bytes verify checked (safetensors, or
                   `torch.load(weights_only=True)` for `.pt`), checked key by key and shape
                   by shape, moved to the target device, then assigned into the module in
                   place of its meta tensors
    warm_up        one small batch, so the first request does not pay for kernel setup

With a `LoadWatch`, device memory is read before and after each stage (the model
ledger, capability/memory.py), and the weights' bytes, known exactly once the module
is built on the meta device, are offered to it before any weight file is read: it
refuses a version that cannot fit by raising.

Verification comes before any weight file is parsed, so a modified file never reaches
a parser. Every file is read once, through the opened folder (files.py), and what is
parsed is the bytes that were hashed: no file is opened again by its path, and no
tensor is a memory map of a file, so a file swapped after verify, or rewritten in place
while its version serves, changes nothing that is served. The price is memory: the
weight files' bytes are held from verify until each is parsed, and a part's tensors are
copied out of its file's bytes (safetensors builds each tensor its own buffer), so the
host holds the weights once more, at most, while a version loads. Assigning the loaded
tensors (rather than copying into allocated parameters) means each weight then exists
once, on the target device.
"""

from __future__ import annotations

import io
import math
import pickle
import stat
import time
import zipfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as parse_safetensors
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812 - the conventional alias
from torch.overrides import TorchFunctionMode

from capability.bundle.errors import (
    BundleConfigInvalid,
    BundleError,
    BundleFileMissing,
    BundleShapeMismatch,
    ModelLoadError,
    UnexpectedBundleFile,
    UnsafeWeights,
)
from capability.bundle.files import BundleFolder, not_regular
from capability.bundle.format import (
    CONFIG_FILE,
    LINEAR_HEAD,
    MANIFEST_FILE,
    TOKENIZER_FILE,
    WEIGHT_LIKE_SUFFIXES,
    WEIGHT_SUFFIXES,
    BundleConfig,
    WeightPart,
)
from capability.bundle.manifest import (
    Manifest,
    check_file,
    check_only_listed_files,
    read_listed_file,
    read_manifest,
    write_manifest,
)
from capability.bundle.minilm import parse_tokenizer
from capability.bundle.signing import SIGNATURE_FILE
from capability.memory import LoadWatch, StageMemory
from capability.model import (
    DEFAULT_GRAPH,
    GRAPHS,
    PRECISION_DTYPES,
    ClassifierHead,
    EncoderConfig,
    LinearHead,
    SentenceEncoder,
    StaticEmbeddingEncoder,
    TextClassifier,
    TextEncoder,
    TextTokenizer,
    TokenizerFailed,
    ZeroShotHead,
)
from classify_common.documents import MAX_DOCUMENT_BYTES, DocumentRefused, parse_json

STAGES = ("read_metadata", "build_module", "verify", "load_weights", "trace_graph", "warm_up")

# tokenizer.json is read whole and parsed. Ours holds 30,522 tokens in 466 KB (15 bytes a
# token); this bound leaves room for vocabularies of millions and refuses, by its manifest
# size and unread, a file that would only cost host memory.
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
# The most bytes a stored value may take: float64, the widest floating-point type a weight
# file may hold (_load_part casts each tensor to the module's type).
_MAX_BYTES_PER_VALUE = 8
# Beside its values, a weight file holds a header (safetensors: one line of JSON per
# tensor) or archive records (.pt): a few hundred bytes a tensor, far below this.
_WEIGHT_FILE_OVERHEAD_BYTES = 1024 * 1024


@dataclass(frozen=True)
class LoadedBundle:
    """A verified, loaded and warmed-up model version, and what loading it cost."""

    name: str  # from config.json, e.g. "topic-minilm"
    # The name it serves as, e.g. "1": its folder's name under the model folder, which
    # need not be `directory`'s (a version folder may be a link within the model root).
    version: str
    directory: Path
    digest: str  # SHA-256 hex of manifest.json
    architecture: str  # "bert-encoder" | "static-embedding"
    precision: str  # "fp32" | "bf16": what the encoder computes in
    graph: str  # "torchscript" | "eager": how the encoder's forward runs
    classifier: TextClassifier
    # This loader's part, verification and its warm-up included; the worker's warm-up
    # and memory measurement follow (WorkerPool.load_seconds is the whole load).
    load_seconds: float
    stage_seconds: Mapping[str, float]  # seconds per stage, keys in STAGES order
    memory_bytes: int  # parameters + buffers on the device
    # Device memory before and after each stage, in STAGES order (with a LoadWatch).
    stage_memory: tuple[StageMemory, ...] = ()
    # What a forward's memory beyond the weights depends on, the batch aside: two
    # versions alike here need the same activations and workspaces, so a live reload
    # carries the serving version's measured overhead over (workers/worker.py). Label
    # names, descriptions and the head's scale are left out: they change no tensor's
    # size. Empty: unknown, always measured.
    compute_shape: tuple[object, ...] = ()


def _load_parts(
    config: BundleConfig,
    encoder: TextEncoder,
    head: ClassifierHead,
    contents: dict[str, bytes],
    part_files: Mapping[str, str],
    target: torch.device,
) -> None:
    """Every weight part into the module that owns it, from the bytes verify checked
    (`contents`, by file name), then check nothing was left out."""
    for part in config.weight_parts():
        owner = encoder if part.owner == "encoder" else head
        name = part_files[part.name]
        # Popped, so that each file's bytes are let go as soon as its part is loaded.
        _load_part(owner, part, name, contents.pop(name), target)
    _require_fully_loaded(encoder, head, part_files)


def load_bundle(
    directory: Path,
    device: torch.device | str = "cpu",
    *,
    version: str | None = None,
    precision: str | None = None,
    graph: str = DEFAULT_GRAPH,
    trusted_signers: Path | None = None,
    watch: LoadWatch | None = None,
) -> LoadedBundle:
    """Verify and load the bundle in `directory` onto `device`, ready to serve (blocking).

    `version` is the name it serves as; None takes `directory`'s own. The model root
    passes the name it listed: a version folder `2` that links to `.release-2` (or to
    `1`) within the root is loaded from the resolved folder, and is still version 2.

    `precision` None uses the bundle's own (config.json); "fp32" or "bf16" overrides it.
    `graph` is how the encoder runs (capability.model.classifier.GRAPHS).
    `trusted_signers` (an OpenSSH allowed-signers file) requires manifest.json.sig by
    one of its keys (signing.py); None loads unsigned bundles too. Raises a BundleError
    naming the file at fault. `watch` reads device memory around each stage and may
    refuse the weights' bytes before they are read (its own error). Safe from several
    threads at once, one device each.
    """
    directory, target = Path(directory), torch.device(device)
    _check_load_options(precision, graph)
    started = time.perf_counter()
    times = _StageTimes(watch)
    stage = times.stage

    with BundleFolder(directory) as folder:
        with stage("read_metadata"):
            manifest, config, tokenizer, part_files = _read_metadata(folder, trusted_signers)
            chosen_precision = precision or config.precision

        with stage("build_module"):
            encoder, head = _build_on_meta(config, PRECISION_DTYPES[chosen_precision])
            _refuse_oversized_parts(config, encoder, head, manifest, part_files)
        if watch is not None:
            watch.admit_weights(_module_bytes(encoder) + _module_bytes(head))

        with stage("verify"):
            contents = _read_unread_files(folder, manifest, set(part_files.values()))

    with stage("load_weights"):
        _load_parts(config, encoder, head, contents, part_files, target)
        classifier = _assemble(config, tokenizer, encoder, head, target, chosen_precision)

    with stage("trace_graph"):
        classifier.use_graph(graph)

    with stage("warm_up"):
        try:
            classifier.warm_up()
        except TokenizerFailed as exc:
            raise ModelLoadError(f"{TOKENIZER_FILE}: fails on the warm-up texts: {exc}") from exc

    return LoadedBundle(
        name=config.name,
        version=version or directory.name,
        directory=directory,
        digest=manifest.digest,
        architecture=config.architecture,
        precision=chosen_precision,
        graph=graph,
        classifier=classifier,
        load_seconds=time.perf_counter() - started,
        stage_seconds=times.seconds,
        memory_bytes=classifier.memory_bytes(),
        stage_memory=tuple(times.memory),
        compute_shape=(
            config.architecture,
            config.encoder,
            config.max_seq_length,
            config.pooling,
            config.head.type,
            len(config.labels),
            chosen_precision,
            graph,
        ),
    )


def check_bundle_metadata(directory: Path, trusted_signers: Path | None = None) -> BundleConfig:
    """The first stage of a load on its own, reading no weight file: manifest.json
    (and its signature, with `trusted_signers`), the folder holding exactly its files,
    config.json and tokenizer.json parsed, and a weight file for every part of the model
    config.json describes, none of another, and no other file. Raises what load_bundle
    would."""
    with BundleFolder(Path(directory)) as folder:
        _, config, _, _ = _read_metadata(folder, trusted_signers)
    return config


def write_bundle_manifest(directory: Path) -> str:
    """Write manifest.json for a folder holding a bundle's files, once they are all a
    bundle may hold; return the new digest.

    For a folder a team built themselves: write_manifest lists whatever the folder
    holds, so this first refuses what a load would (UnexpectedBundleFile, naming the
    file): an entry that is not a regular file, a weight file of no part of the model
    config.json describes, a part stored twice; and what no bundle holds (a
    tokenizer_config.json, a README). A part or file missing is BundleFileMissing,
    a config.json the server would refuse is BundleConfigInvalid. A
    manifest.json.sig present is refused: it signs the manifest about to be replaced.
    """
    directory = Path(directory)
    with BundleFolder(directory) as folder:
        names = _bundle_file_names(folder)
        config = _parse_config(folder.read_bounded(CONFIG_FILE, MAX_DOCUMENT_BYTES))
        if TOKENIZER_FILE not in names:
            raise BundleFileMissing(f"{TOKENIZER_FILE}: not found in {directory}")
        part_files = _locate_parts(directory, names, config, "in the folder")
        _refuse_files_of_no_bundle(
            names, part_files, "move it out of the folder before writing the manifest"
        )
    return write_manifest(directory)


def _refuse_files_of_no_bundle(
    names: Collection[str], part_files: Mapping[str, str], advice: str
) -> None:
    """Refuse (UnexpectedBundleFile, naming the first) any of `names` but config.json,
    tokenizer.json and the weight files `part_files`: what no bundle holds."""
    known = {CONFIG_FILE, TOKENIZER_FILE, *part_files.values()}
    others = sorted(set(names) - known)
    if others:
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise UnexpectedBundleFile(
            f"{others[0]}{more}: not a file of a bundle, which holds {CONFIG_FILE}, "
            f"{TOKENIZER_FILE} and its weight files {sorted(part_files.values())}; {advice}"
        )


def _bundle_file_names(folder: BundleFolder) -> list[str]:
    """The folder's files but manifest.json and write_manifest's own partial file,
    refusing an entry that is not a regular file and a signature; config.json must be
    there (BundleFileMissing)."""
    names: list[str] = []
    for name, mode in folder.entries():
        if name in {MANIFEST_FILE, f".{MANIFEST_FILE}.partial"}:
            continue
        if not stat.S_ISREG(mode):
            raise not_regular(name, mode)
        if name == SIGNATURE_FILE:
            raise UnexpectedBundleFile(
                f"{SIGNATURE_FILE}: signs the {MANIFEST_FILE} about to be replaced; remove "
                "it, write the manifest, then sign the bundle again"
            )
        names.append(name)
    if CONFIG_FILE not in names:
        raise BundleFileMissing(f"{CONFIG_FILE}: not found in {folder.path}")
    return names


def _read_metadata(
    folder: BundleFolder, trusted_signers: Path | None
) -> tuple[Manifest, BundleConfig, TextTokenizer, dict[str, str]]:
    """The read_metadata stage: the manifest, config.json, the tokenizer, and each
    weight part's file name."""
    manifest = read_manifest(folder, trusted_signers)
    check_only_listed_files(folder, manifest)
    config = _read_config(folder, manifest)
    tokenizer = _read_tokenizer(folder, manifest, config)
    part_files = _locate_parts(
        folder.path, manifest.files.keys(), config, f"listed in {MANIFEST_FILE}"
    )
    # Listed or not: a manifest vouches for a bundle's files, and makes nothing else one.
    # A listed payload.py or tokenizer_config.json loaded, and was hashed in full at
    # every load, however large.
    _refuse_files_of_no_bundle(
        manifest.files.keys(),
        part_files,
        f"listed in {MANIFEST_FILE}, but refused all the same: move it out of the folder "
        "and write the manifest again",
    )
    return manifest, config, tokenizer, part_files


def _module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (exact on the meta device too)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_load_options(precision: str | None, graph: str) -> None:
    if precision is not None and precision not in PRECISION_DTYPES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_DTYPES)}, got {precision!r}")
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}")


class _StageTimes:
    """Seconds each load stage took, by name, in the order they ran, and with a
    LoadWatch the device memory before and after each."""

    def __init__(self, watch: LoadWatch | None) -> None:
        self.seconds: dict[str, float] = {}
        self.memory: list[StageMemory] = []
        self._watch = watch

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        before = self._watch.read() if self._watch is not None else None
        begun = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - begun
        if self._watch is not None and before is not None:
            self.memory.append(StageMemory(name, before, self._watch.read()))


def _read_unread_files(
    folder: BundleFolder, manifest: Manifest, weight_files: Collection[str]
) -> dict[str, bytes]:
    """Check every listed file against the manifest but config.json and tokenizer.json
    (checked as they were read), keeping the weight files' bytes, by name: they are what
    load_weights parses, so a file swapped after its check is never read."""
    already_checked = {CONFIG_FILE, TOKENIZER_FILE}
    contents: dict[str, bytes] = {}
    for name, entry in sorted(manifest.files.items()):
        if name in weight_files:
            contents[name] = read_listed_file(folder, name, entry)
        elif name not in already_checked:
            check_file(folder, name, entry)
    return contents


def _refuse_oversized_parts(
    config: BundleConfig,
    encoder: TextEncoder,
    head: ClassifierHead,
    manifest: Manifest,
    part_files: Mapping[str, str],
) -> None:
    """Refuse a weight file larger than its part of the model can need, by the size
    the manifest records: verify reads each weight file whole into memory, so a file
    padded with tensors the model has no place for (refused at load_weights anyway)
    would first cost its whole size in host memory, whatever the memory budget."""
    for part in config.weight_parts():
        name = part_files[part.name]
        module = encoder if part.owner == "encoder" else head
        values = sum(t.numel() for t in _part_tensors(module, part).values())
        most = values * _MAX_BYTES_PER_VALUE + _WEIGHT_FILE_OVERHEAD_BYTES
        size = manifest.files[name].size
        if size > most:
            raise BundleShapeMismatch(
                f"{name}: {size} bytes in {MANIFEST_FILE}, more than its part of the model "
                f"can need: {most} bytes ({values} values of at most {_MAX_BYTES_PER_VALUE} "
                f"bytes, plus {_WEIGHT_FILE_OVERHEAD_BYTES} for the file's own records); "
                "refused before it is read"
            )


def _require_listed(folder: BundleFolder, manifest: Manifest, name: str) -> None:
    # A file present but not listed was refused already (check_only_listed_files).
    if name not in manifest.files:
        raise BundleFileMissing(f"{name}: not found in {folder.path}")


def _read_config(folder: BundleFolder, manifest: Manifest) -> BundleConfig:
    _require_listed(folder, manifest, CONFIG_FILE)
    data = read_listed_file(
        folder, CONFIG_FILE, manifest.files[CONFIG_FILE], max_bytes=MAX_DOCUMENT_BYTES
    )
    return _parse_config(data)


def _parse_config(data: bytes) -> BundleConfig:
    try:
        document: object = parse_json(data, CONFIG_FILE)
    except DocumentRefused as exc:  # too deep, duplicate keys, not JSON
        raise BundleConfigInvalid(str(exc)) from exc
    return BundleConfig.from_json(document)


def _read_tokenizer(
    folder: BundleFolder, manifest: Manifest, config: BundleConfig
) -> TextTokenizer:
    _require_listed(folder, manifest, TOKENIZER_FILE)
    entry = manifest.files[TOKENIZER_FILE]
    if entry.size > MAX_TOKENIZER_BYTES:
        raise BundleConfigInvalid(
            f"{TOKENIZER_FILE}: {entry.size} bytes in {MANIFEST_FILE}, over the "
            f"{MAX_TOKENIZER_BYTES}-byte limit for a tokenizer; refused before it is read"
        )
    data = read_listed_file(folder, TOKENIZER_FILE, entry)
    try:
        return parse_tokenizer(data, TOKENIZER_FILE, config.lowercase, config.vocab_size)
    except ModelLoadError as exc:
        # Already names tokenizer.json; re-raised as a BundleError so callers need one except.
        raise BundleError(str(exc)) from exc


def _locate_parts(
    directory: Path, names: Collection[str], config: BundleConfig, found: str
) -> dict[str, str]:
    """Each weight part's file name among `names` (`found` says where they are, for a
    refusal), refusing parts missing, stored twice, or not ours."""
    chosen: dict[str, str] = {}
    for part in config.weight_parts():
        candidates = [part.name + s for s in WEIGHT_SUFFIXES if part.name + s in names]
        if not candidates:
            raise BundleFileMissing(
                f"{part.name}{WEIGHT_SUFFIXES[0]}: not found in {directory} "
                f"(nor {', '.join(part.name + s for s in WEIGHT_SUFFIXES[1:])})"
            )
        if len(candidates) > 1:
            raise UnexpectedBundleFile(
                f"{candidates[1]}: holds the same part as {candidates[0]}; keep only one"
            )
        chosen[part.name] = candidates[0]
    foreign = sorted(
        name
        for name in names
        # Any case: HEAD.PT is a weight file on a case-insensitive file system.
        if Path(name).suffix.lower() in WEIGHT_LIKE_SUFFIXES and name not in chosen.values()
    )
    if foreign:
        raise UnexpectedBundleFile(
            f"{foreign[0]}: {found} but not a weight file of this "
            f"{config.architecture} model (expected {sorted(chosen.values())})"
        )
    return chosen


@contextmanager
def constructing_on_meta() -> Iterator[None]:
    """Modules constructed inside are shapes only: on the meta device, with no memory
    and no values set (see _ValuesLeftUnset). Every tensor is to be replaced by a
    loaded one."""
    with torch.device("meta"), _ValuesLeftUnset():
        yield


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite, from its least and greatest (a NaN
    is both, an infinity one of them). NOTE: not torch.isfinite(tensor).all(), whose
    mask as large as the tensor (12 MB for MiniLM's embeddings) stayed in the
    process's resident set on the CPU, where a load's footprint is that set's growth:
    some loads measured twice the footprint of others, and the residency budget held
    fewer models than it should."""
    if tensor.numel() == 0:
        return True
    least, greatest = torch.aminmax(tensor)
    return math.isfinite(float(least)) and math.isfinite(float(greatest))


def _build_on_meta(config: BundleConfig, dtype: torch.dtype) -> tuple[TextEncoder, ClassifierHead]:
    """The module config.json describes, shapes only; a refusal by torch (a size it
    cannot allocate even on the meta device) is config.json's, naming it."""
    try:
        return _construct_on_meta(config, dtype)
    except (RuntimeError, ValueError) as exc:
        # NOTE: format.py bounds every dimension, so this is a second line: a torch
        # error here took a start down, as no ModelLoadError, and named no file.
        raise BundleConfigInvalid(
            f"{CONFIG_FILE}: the model it describes cannot be built: {exc}"
        ) from exc


def _construct_on_meta(
    config: BundleConfig, dtype: torch.dtype
) -> tuple[TextEncoder, ClassifierHead]:
    # Every tensor is replaced by a loaded one in `load_weights`.
    with constructing_on_meta():
        encoder: TextEncoder
        if isinstance(config.encoder, EncoderConfig):
            encoder = SentenceEncoder(config.encoder)
        else:
            encoder = StaticEmbeddingEncoder(config.encoder)
        head: ClassifierHead
        if config.head.type == LINEAR_HEAD:
            head = LinearHead(len(config.labels), config.hidden_size)
        else:
            assert config.head.scale is not None, "config parsing requires a zero-shot scale"
            head = ZeroShotHead(
                torch.empty(len(config.labels), config.hidden_size), config.head.scale
            )
    # The encoder computes in the chosen precision; heads always in float32 (see
    # PRECISION_DTYPES), so their weights are loaded as float32.
    return encoder.to(dtype=dtype), head.float()


class _ValuesLeftUnset(TorchFunctionMode):
    """Constructors' calls that only set or rescale values return their tensor as it
    came: torch.nn.init's initialisers, and F.normalize (the zero-shot head normalises
    its prototypes). A meta tensor has no values to set, and torch runs some of these
    on the meta device through Python fallbacks whose first call imports torch._dynamo:
    about 2 s and 70 MB of every capability process's first load."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.normalize or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor" if "tensor" in kwargs else "input"]
        return func(*args, **kwargs)


def _read_weights(name: str, data: bytes, device: torch.device) -> dict[str, Tensor]:
    """The tensors in one weight file's bytes; never runs code from the file.

    Safetensors parts come back on the CPU, each tensor in memory of its own (never a
    view of the file); `.pt` parts come back on `device`."""
    if name.endswith(".safetensors"):
        try:
            # safetensors is a header plus raw bytes: reading it cannot execute anything.
            return parse_safetensors(data)
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise BundleError(f"{name}: cannot be read as safetensors: {exc}") from exc
    _refuse_compressed_records(name, data)
    try:
        # weights_only restricts the unpickler to tensors and plain containers; a pickle
        # that names any other callable (os.system, a class's __reduce__) is refused
        # before that callable is looked up, let alone called.
        loaded: object = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch wraps the unpickler's own complaint ("unsupported GLOBAL posix.system") in
        # generic advice to retry with weights_only=False, which must not be repeated here.
        reason = str(exc.__context__ or exc).strip() or type(exc).__name__
        raise UnsafeWeights(
            f"{name}: refused by the weights-only unpickler ({reason}); a .pt part may hold "
            "only tensors in plain containers, since anything else could run code"
        ) from exc
    except Exception as exc:  # torch raises RuntimeError and others for corrupt archives
        raise BundleError(f"{name}: cannot be read as a torch weights file: {exc}") from exc
    if not isinstance(loaded, dict) or not all(
        isinstance(key, str) and isinstance(value, Tensor) for key, value in loaded.items()
    ):
        raise BundleError(f"{name}: expected a dict of tensor names to tensors")
    return loaded


def _refuse_compressed_records(name: str, data: bytes) -> None:
    """Refuse a `.pt` part that is no zip archive, or one with a compressed record.
    torch.save stores its records as they are, so a file's size bounds what it expands
    to, and the size check above
    (_refuse_oversized_parts) relies on that; a deflated record of zeros 1,000 times
    its size (a 0.5 MB head part holding 512 MiB) was expanded in memory, on the device
    with a CUDA map_location, before its shape was checked."""
    stream = io.BytesIO(data)
    if not zipfile.is_zipfile(stream):
        # torch's legacy format (before 1.6) sizes each storage from its pickle and
        # allocates it before reading: a 280 KB file asked for 4 GiB.
        raise BundleError(
            f"{name}: not a zip archive (torch's legacy format, whose storages are sized "
            "by the pickle before they are read); save it again with torch.save"
        )
    try:
        with zipfile.ZipFile(stream) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise BundleError(f"{name}: cannot be read as a torch weights file: {exc}") from exc
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED:
            raise BundleError(
                f"{name}: record {record.filename!r} is compressed; a .pt part's records "
                "must be stored as torch.save writes them, so that its size bounds "
                "what it holds"
            )


def _load_part(
    owner: nn.Module, part: WeightPart, name: str, data: bytes, device: torch.device
) -> None:
    """Assign one file's tensors into `owner`'s submodule, refusing any misfit by name."""
    module = owner.get_submodule(part.prefix.rstrip(".")) if part.prefix else owner
    expected = _part_tensors(owner, part)
    weights = _read_weights(name, data, device)
    # The tensors are copies: the file's bytes can go before any are moved or cast.
    del data
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise BundleShapeMismatch(
            f"{name}: tensor {missing[0]} is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    unexpected = sorted(weights.keys() - expected.keys())
    if unexpected:
        raise BundleShapeMismatch(
            f"{name}: tensor {unexpected[0]} is not part of the model"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    assigned: dict[str, Tensor] = {}
    for key, like in expected.items():
        tensor = weights[key]
        if tensor.shape != like.shape:
            raise BundleShapeMismatch(
                f"{name}: tensor {key} has shape {tuple(tensor.shape)}, but "
                f"{CONFIG_FILE} implies {tuple(like.shape)}"
            )
        if not tensor.is_floating_point():
            raise BundleShapeMismatch(
                f"{name}: tensor {key} is {tensor.dtype}; weights must be floating point"
            )
        # Moved as stored, then cast on the device to the precision the module was built
        # in (on a GPU the cast is the device's work, not the host's).
        loaded = tensor.to(device=device).to(dtype=like.dtype)
        # Checked as computed with (a float64 value past float32's range is inf now):
        # a NaN weight was refused only by the worker's warm-up, naming the version's
        # folder rather than the file and the tensor to look at.
        if not _all_finite(loaded):
            raise BundleShapeMismatch(
                f"{name}: tensor {key} holds non-finite values (NaN or infinity) as "
                f"{str(like.dtype).removeprefix('torch.')}"
            )
        assigned[key[len(part.prefix) :]] = loaded
    module.load_state_dict(assigned, strict=True, assign=True)


def _part_tensors(owner: nn.Module, part: WeightPart) -> dict[str, Tensor]:
    """The tensors of `owner` that `part`'s file holds, by their key in that file."""
    module = owner.get_submodule(part.prefix.rstrip(".")) if part.prefix else owner
    return {part.prefix + key: t for key, t in module.state_dict().items()}


def _require_fully_loaded(
    encoder: TextEncoder, head: ClassifierHead, part_files: Mapping[str, str]
) -> None:
    # The parts' prefixes are meant to cover the whole model; a tensor still on the meta
    # device would mean the format and the model disagree, which is a bug here, not in
    # the bundle.
    for module in (encoder, head):
        for key, tensor in module.state_dict().items():
            if tensor.is_meta:
                raise AssertionError(f"{key} is in no weight part of {sorted(part_files.values())}")


def _assemble(
    config: BundleConfig,
    tokenizer: TextTokenizer,
    encoder: TextEncoder,
    head: ClassifierHead,
    device: torch.device,
    precision: str,
) -> TextClassifier:
    try:
        return TextClassifier(
            tokenizer=tokenizer,
            encoder=encoder,
            head=head,
            labels=config.labels,
            max_seq_length=config.max_seq_length,
            device=device,
            precision=precision,
        )
    except ValueError as exc:
        raise BundleConfigInvalid(f"{CONFIG_FILE}: {exc}") from exc
