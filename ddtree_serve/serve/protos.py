"""gRPC stubs for protos/ddtree_serve.proto, generated on first import in every process.

Generated code refuses to import under an older grpcio/protobuf than the grpc_tools that wrote
it, so stubs are built here from the .proto against the installed versions instead of being
committed. Each (proto, grpc_tools, protobuf) combination gets its own versioned package under
``_generated/`` that is written once into a temporary directory and renamed into place, so
concurrent first imports (the driver, Serve proxies, replicas) never see a half-written package.

Ray Serve's gRPC proxy imports ``add_DDTreeServeServicer_to_server`` from this module by path.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

import grpc_tools
from google import protobuf
from grpc_tools import protoc

PROTO_NAME = "ddtree_serve.proto"
_PACKAGE_DIR = Path(__file__).resolve().parent
_GENERATED_DIR = _PACKAGE_DIR / "_generated"
_GENERATED_PACKAGE = f"{__package__}._generated"


def _proto_dir() -> Path:
    """protos/ in a source checkout (editable installs) or next to the package when bundled."""
    candidates = (_PACKAGE_DIR.parents[1] / "protos", _PACKAGE_DIR / "protos")
    for candidate in candidates:
        if (candidate / PROTO_NAME).is_file():
            return candidate
    raise FileNotFoundError(f"{PROTO_NAME} not found in any of {[str(c) for c in candidates]}")


def _version_tag(proto_text: bytes) -> str:
    """Names the generated package after everything that changes the generated code."""
    digest = hashlib.sha256(proto_text)
    digest.update(protobuf.__version__.encode())
    digest.update(_grpc_tools_version().encode())
    return "v_" + digest.hexdigest()[:16]


def _grpc_tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def _generate(proto_dir: Path, tag: str) -> None:
    """Writes ``_generated/<tag>/`` atomically; a concurrent writer that wins the rename is fine."""
    _GENERATED_DIR.mkdir(exist_ok=True)
    (_GENERATED_DIR / "__init__.py").touch()
    target = _GENERATED_DIR / tag
    if target.is_dir():
        return
    staging_root = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=_GENERATED_DIR))
    try:
        # Namespace trick: mapping the package path onto protos/ makes the generated *_pb2_grpc
        # import its *_pb2 by the full package path, which works inside an installed package.
        package_path = "/".join([*_GENERATED_PACKAGE.split("."), tag])
        include_root = Path(grpc_tools.__file__).parent / "_proto"
        exit_code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{package_path}={proto_dir}",
                f"-I{include_root}",
                f"--python_out={staging_root}",
                f"--grpc_python_out={staging_root}",
                f"{package_path}/{PROTO_NAME}",
            ]
        )
        if exit_code != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with exit code {exit_code} on {proto_dir}")
        staged = staging_root / package_path
        (staged / "__init__.py").touch()
        try:
            os.rename(staged, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)


def _load() -> tuple[ModuleType, ModuleType]:
    proto_dir = _proto_dir()
    tag = _version_tag((proto_dir / PROTO_NAME).read_bytes())
    _generate(proto_dir, tag)
    module_prefix = f"{_GENERATED_PACKAGE}.{tag}.ddtree_serve"
    return importlib.import_module(f"{module_prefix}_pb2"), importlib.import_module(
        f"{module_prefix}_pb2_grpc"
    )


pb2, pb2_grpc = _load()

DDTreeServeStub = pb2_grpc.DDTreeServeStub
add_DDTreeServeServicer_to_server = pb2_grpc.add_DDTreeServeServicer_to_server
SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["DDTreeServe"].full_name

if __name__ == "__main__":
    print(f"generated {pb2.__name__} and {pb2_grpc.__name__}")
