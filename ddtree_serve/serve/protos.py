"""gRPC stubs for protos/ddtree_serve.proto, generated on first import in every process.

Generated code refuses to import under an older grpcio/protobuf than the grpc_tools that wrote
it, so stubs are built here from the .proto against the installed versions instead of being
committed. Each (proto, grpc_tools, protobuf) combination gets its own versioned package under
``_generated/`` that is written once into a temporary directory and renamed into place, so
concurrent first imports (the driver, Serve proxies, replicas) never see a half-written package.

Ray Serve's gRPC proxy imports ``add_DDTreeServeServicer_to_server`` and
``add_HealthServicer_to_server`` from this module by path. Unlike the generated ones, they
register the methods without a request deserializer: the proxy forwards the request bytes and
the ingress decodes them (`grpc_decode`), so an undecodable message is refused with
INVALID_ARGUMENT naming the field instead of failing inside the proxy as UNKNOWN.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

import grpc
import grpc_tools
from google import protobuf
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
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
SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["DDTreeServe"].full_name


def add_DDTreeServeServicer_to_server(servicer: object, server: grpc.Server) -> None:
    _add_undecoded_servicer(pb2.DESCRIPTOR.services_by_name["DDTreeServe"], servicer, server)


def add_HealthServicer_to_server(servicer: object, server: grpc.Server) -> None:
    _add_undecoded_servicer(health_pb2.DESCRIPTOR.services_by_name["Health"], servicer, server)


def _add_undecoded_servicer(service: ServiceDescriptor, servicer: object, server: grpc.Server) -> None:
    """What the generated ``add_*_to_server`` does, with the request left as bytes."""
    handlers = {}
    for method in service.methods:
        assert not method.client_streaming, f"{method.full_name}: client streaming is not served"
        make_handler = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=None,
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63, as generated code does
        server.add_registered_method_handlers(service.full_name, handlers)


if __name__ == "__main__":
    print(f"generated {pb2.__name__} and {pb2_grpc.__name__}")
