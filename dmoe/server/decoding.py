"""Bytes that do not parse as the request message get INVALID_ARGUMENT, not gRPC's bare UNKNOWN.

grpc.aio turns an exception raised by a request deserializer into ``UNKNOWN: Unexpected DecodeError``, which
reads like a server bug. This interceptor makes deserialization total (junk becomes an :class:`Undecodable`
value) and answers such a request with INVALID_ARGUMENT naming the message type, before any handler runs.
"""
from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Callable

import grpc


class Undecodable:
    """What a request that failed to parse becomes instead of an exception."""

    def __init__(self, error: Exception):
        self.error = error

    def message(self, method: str) -> str:
        return f"{method}: the request bytes are not a valid message ({type(self.error).__name__}: {self.error})"


def _total(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as error:  # whatever the parser raises on junk
            return Undecodable(error)

    return parse


class RejectUndecodable(grpc.aio.ServerInterceptor):
    """Server interceptor for every kind of method (ExpertService's unary and streamed calls, ReplicaService's
    client-streamed push and server-streamed fetch).

    The wrapped handler of each method is built once and reused: gRPC asks the interceptor on every call.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (its handler, the wrapped one)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._wrapped.get(details.method)  # only methods the server has: unknown ones have no handler
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(details.method, handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(method: str, handler):
        parse = _total(handler.request_deserializer)
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
                return await behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=parse,
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream is not None and not inspect.isasyncgenfunction(handler.unary_stream):
            behavior = handler.unary_stream

            async def unary_stream_writing(request, context):  # a handler that sends with context.write
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
                await behavior(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream_writing, request_deserializer=parse,
                                                        response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            behavior = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
                async for response in behavior(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=parse,
                                                        response_serializer=handler.response_serializer)

        def checked(requests: AsyncIterator, context) -> AsyncIterator:
            async def parsed():
                async for request in requests:
                    if isinstance(request, Undecodable):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
                    yield request
            return parsed()

        if handler.stream_stream is not None and not inspect.isasyncgenfunction(handler.stream_stream):
            behavior = handler.stream_stream

            async def stream_stream_writing(requests: AsyncIterator, context):  # sends with context.write
                await behavior(checked(requests, context), context)

            return grpc.stream_stream_rpc_method_handler(stream_stream_writing, request_deserializer=parse,
                                                         response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:
            behavior = handler.stream_stream

            async def stream_stream(requests: AsyncIterator, context):
                async for response in behavior(checked(requests, context), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=parse,
                                                         response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:
            behavior = handler.stream_unary

            async def stream_unary(requests: AsyncIterator, context):
                return await behavior(checked(requests, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=parse,
                                                        response_serializer=handler.response_serializer)
        return handler
