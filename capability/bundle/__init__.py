"""Model bundles: one verified directory per model version, loaded onto a device.

    <root>/<model-name>/<version>/  config.json, tokenizer.json, per-module weight files,
                                    manifest.json (size + SHA-256 of every other file),
                                    manifest.json.sig (optional SSH signature, signing.py)

`build_bundle` writes one (also `python -m capability.bundle build`), `verify_bundle`
checks one against its manifest, `check_bundle_metadata` parses its config and tokenizer
as a load would, `write_bundle_manifest` lists a folder of bundle files built elsewhere
once it holds nothing a load would refuse, `load_bundle` verifies, loads and warms one
up. Every refusal is a `BundleError` (a `ModelLoadError`) whose message starts with the
file at fault. See format.py for the layout and loader.py for the load stages.
"""

from capability.bundle.builder import HEAD_CHOICES, MODEL_KINDS, build_bundle
from capability.bundle.errors import (
    BundleConfigInvalid,
    BundleError,
    BundleFileMissing,
    BundleHashMismatch,
    BundleShapeMismatch,
    BundleSignatureInvalid,
    BundleSignerUntrusted,
    BundleUnsigned,
    MemoryBudgetExceeded,
    ModelLoadError,
    UnexpectedBundleFile,
    UnsafeWeights,
)
from capability.bundle.format import BundleConfig
from capability.bundle.loader import (
    STAGES,
    LoadedBundle,
    check_bundle_metadata,
    load_bundle,
    write_bundle_manifest,
)
from capability.bundle.manifest import verify_bundle, write_manifest
from capability.bundle.minilm import load_minilm_classifier
from capability.bundle.signing import check_manifest_signature, sign_manifest

__all__ = [
    "HEAD_CHOICES",
    "MODEL_KINDS",
    "STAGES",
    "BundleConfig",
    "BundleConfigInvalid",
    "BundleError",
    "BundleFileMissing",
    "BundleHashMismatch",
    "BundleShapeMismatch",
    "BundleSignatureInvalid",
    "BundleSignerUntrusted",
    "BundleUnsigned",
    "LoadedBundle",
    "MemoryBudgetExceeded",
    "ModelLoadError",
    "UnexpectedBundleFile",
    "UnsafeWeights",
    "build_bundle",
    "check_bundle_metadata",
    "check_manifest_signature",
    "load_bundle",
    "load_minilm_classifier",
    "sign_manifest",
    "verify_bundle",
    "write_bundle_manifest",
    "write_manifest",
]
