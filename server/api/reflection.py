"""gRPC server reflection, v1 and v1alpha, serving descriptors *with* their comments.

grpcio-reflection serves v1alpha only, and from the process's descriptor pool, whose files
carry no ``source_code_info``: grpcurl users then never see the documentation written in the
.proto files. Here the files come from ``rollout/v1/descriptor_set.binpb``, a descriptor set
that ``scripts/gen_protos.sh`` builds with ``--include_source_info``; files outside it (health,
reflection itself, the well-known types) come from the pool without comments. The same answer
logic serves both protocol versions: v1 is v1alpha under another package name, so its
message classes are built here from v1alpha's descriptor with the package renamed.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

DESCRIPTOR_SET = "descriptor_set.binpb"
"""Inside the ``rollout.v1`` package, next to the generated code."""
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
_METHOD = "ServerReflectionInfo"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto renamed to grpc.reflection.v1 (identical messages)."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = "grpc.reflection.v1"
    proto.options.Clear()

    def rename(msg: descriptor_pb2.DescriptorProto) -> None:
        for f in msg.field:
            if f.type_name.startswith(".grpc.reflection.v1alpha."):
                f.type_name = ".grpc.reflection.v1." + f.type_name.rsplit(".", 1)[1]
        for nested in msg.nested_type:
            rename(nested)

    for m in proto.message_type:
        rename(m)
    for svc in proto.service:
        for meth in svc.method:
            meth.input_type = meth.input_type.replace(".v1alpha.", ".v1.")
            meth.output_type = meth.output_type.replace(".v1alpha.", ".v1.")
    return proto


_V1_POOL = descriptor_pool.DescriptorPool()
_V1_POOL.Add(_v1_file())
V1Request: Any = message_factory.GetMessageClass(
    _V1_POOL.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
V1Response: Any = message_factory.GetMessageClass(
    _V1_POOL.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))


def load_descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    data = importlib.resources.files("rollout.v1").joinpath(DESCRIPTOR_SET).read_bytes()
    return descriptor_pb2.FileDescriptorSet.FromString(data)


class Files:
    """File descriptors by name and the symbols each file defines."""

    def __init__(self, documented: Iterable[descriptor_pb2.FileDescriptorProto],
                 pool: Any = None) -> None:
        self._pool = pool or descriptor_pool.Default()
        self._files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        self._symbols: dict[str, str] = {}
        for f in documented:
            self.add(f)

    def add(self, f: descriptor_pb2.FileDescriptorProto) -> None:
        self._files[f.name] = f
        prefix = f"{f.package}." if f.package else ""

        def message(m: descriptor_pb2.DescriptorProto, scope: str) -> None:
            name = scope + m.name
            self._symbols[name] = f.name
            for field in (*m.field, *m.extension):
                self._symbols[f"{name}.{field.name}"] = f.name
            for e in m.enum_type:
                self._symbols[f"{name}.{e.name}"] = f.name
            for nested in m.nested_type:
                message(nested, name + ".")

        for m in f.message_type:
            message(m, prefix)
        for e in f.enum_type:
            self._symbols[prefix + e.name] = f.name
            for v in e.value:  # enum values live in the enum's parent scope
                self._symbols[prefix + v.name] = f.name
        for s in f.service:
            self._symbols[prefix + s.name] = f.name
            for meth in s.method:  # `grpcurl describe Service.Method` asks for these
                self._symbols[f"{prefix}{s.name}.{meth.name}"] = f.name
        for ext in f.extension:
            self._symbols[prefix + ext.name] = f.name

    def _get(self, name: str) -> descriptor_pb2.FileDescriptorProto | None:
        if name not in self._files:
            try:
                fd = self._pool.FindFileByName(name)
            except KeyError:
                return None
            proto = descriptor_pb2.FileDescriptorProto()
            fd.CopyToProto(proto)
            self.add(proto)
        return self._files[name]

    def file_with_deps(self, name: str) -> list[bytes] | None:
        """The file and everything it imports, transitively (grpcurl needs them all)."""
        first = self._get(name)
        if first is None:
            return None
        out: list[bytes] = []
        seen: set[str] = set()
        stack = [first]
        while stack:
            f = stack.pop()
            if f.name in seen:
                continue
            seen.add(f.name)
            out.append(f.SerializeToString())
            stack += [d for d in (self._get(n) for n in f.dependency) if d is not None]
        return out

    def file_of_symbol(self, symbol: str) -> str | None:
        if symbol in self._symbols:
            return self._symbols[symbol]
        try:  # health, reflection and other services registered only in the pool
            return str(self._pool.FindFileContainingSymbol(symbol).name)
        except KeyError:
            return None


class Reflection:
    """Answers ServerReflectionInfo for both protocol versions from one set of files."""

    def __init__(self, service_names: Iterable[str], files: Files) -> None:
        self._services = sorted(set(service_names) | {V1, V1ALPHA})
        self._files = files

    def answer(self, req: Any, resp_cls: Any) -> Any:
        kind = req.WhichOneof("message_request")
        resp = resp_cls(valid_host=req.host)
        resp.original_request.CopyFrom(req)
        found: list[bytes] | None = None
        if kind == "file_by_filename":
            found = self._files.file_with_deps(req.file_by_filename)
        elif kind == "file_containing_symbol":
            name = self._files.file_of_symbol(req.file_containing_symbol)
            found = self._files.file_with_deps(name) if name else None
        elif kind == "list_services":
            for s in self._services:
                resp.list_services_response.service.add(name=s)
            return resp
        elif kind == "all_extension_numbers_of_type":
            # Our files declare no extensions; an empty answer is the truthful one.
            resp.all_extension_numbers_response.base_type_name = \
                req.all_extension_numbers_of_type
            return resp
        elif kind is None:
            resp.error_response.error_code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            resp.error_response.error_message = "set one message_request field"
            return resp
        if found is None:
            resp.error_response.error_code = grpc.StatusCode.NOT_FOUND.value[0]
            resp.error_response.error_message = f"{kind} not found: {getattr(req, kind)}"
            return resp
        resp.file_descriptor_response.file_descriptor_proto.extend(found)
        return resp

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        def method(req_cls: Any, resp_cls: Any) -> grpc.RpcMethodHandler:
            async def info(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                async for req in requests:
                    yield self.answer(req, resp_cls)

            return grpc.stream_stream_rpc_method_handler(
                info, request_deserializer=req_cls.FromString,
                response_serializer=resp_cls.SerializeToString)

        return [grpc.method_handlers_generic_handler(V1ALPHA, {_METHOD: method(
                    v1alpha_pb2.ServerReflectionRequest, v1alpha_pb2.ServerReflectionResponse)}),
                grpc.method_handlers_generic_handler(V1, {_METHOD: method(
                    V1Request, V1Response)})]


def enable(server: Any, service_names: Iterable[str]) -> Reflection:
    """Serve reflection (v1 and v1alpha) on ``server`` for ``service_names``."""
    documented = list(load_descriptor_set().file)
    documented.append(_v1_file())
    refl = Reflection(service_names, Files(documented))
    server.add_generic_rpc_handlers(refl.handlers())
    return refl
