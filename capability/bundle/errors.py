"""Why a model's files were refused. Every message starts with the offending file's name.

ModelLoadError                a model's files cannot be loaded (any folder)
├── MemoryBudgetExceeded      the version would not fit the worker's device memory budget
└── BundleError               a bundle directory cannot be served
    ├── BundleFileMissing
    ├── BundleHashMismatch
    ├── BundleShapeMismatch
    ├── UnsafeWeights
    ├── BundleConfigInvalid
    ├── UnexpectedBundleFile
    ├── BundleUnsigned
    ├── BundleSignatureInvalid
    └── BundleSignerUntrusted
"""


class ModelLoadError(ValueError):
    """A model folder cannot be loaded: a file is missing, malformed or does not fit the model.

    The message always names the offending file, because the operator fixing it
    is looking at a folder, not at a stack trace.
    """


class MemoryBudgetExceeded(ModelLoadError):
    """A version's predicted or measured footprint does not fit the device memory budget.

    The one refusal that names numbers rather than a file: the bundle is sound, the
    device is too full for it (capability/memory.py).
    """


class BundleError(ModelLoadError):
    """A bundle directory cannot be served; the message starts with the file to look at."""


class BundleFileMissing(BundleError):
    """A file the bundle needs, or one its manifest lists, is not in the directory."""


class BundleHashMismatch(BundleError):
    """A file's size or SHA-256 differs from what manifest.json records for it."""


class BundleShapeMismatch(BundleError):
    """A weight file's tensors do not fit the module config.json describes."""


class UnsafeWeights(BundleError):
    """A `.pt` weight file whose pickle would run code or build objects other than tensors."""


class BundleConfigInvalid(BundleError):
    """config.json or manifest.json is malformed, has unknown keys, or asks for the unsupported."""


class UnexpectedBundleFile(BundleError):
    """A file the bundle does not account for: unlisted, a weight file of no part, a part
    twice, or an entry that is not a regular file (a directory, a symbolic link)."""


class BundleUnsigned(BundleError):
    """Trusted signers are configured, but the bundle has no manifest.json.sig."""


class BundleSignatureInvalid(BundleError):
    """manifest.json.sig is malformed or does not match manifest.json's bytes."""


class BundleSignerUntrusted(BundleError):
    """manifest.json.sig was made by a key the trusted-signers file does not list."""
