"""`epd generate` and `epd count`: the request from flags, the call to the router, the answer as text or JSON.

Bad input (a missing or non-image file, a bad URL) is a usage error before any call; a router that cannot
be reached or that refuses the request is a one-line failure naming the gRPC status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from services.cli_errors import failure, usage_error
from services.common.image_bytes import sniff_format
from services.common.rpc.epd.v1 import generation_pb2
from services.common.video_bytes import sniff_container

DEFAULT_ROUTER = "127.0.0.1:50051"
CONNECT_TIMEOUT_S = 5.0  # a router that does not accept a connection by then is reported unreachable
IMAGE_KINDS = "a JPEG, PNG, WebP, GIF or BMP file"
VIDEO_KINDS = "an MP4 (or MOV) or WebM/Matroska file"
URL_SCHEMES = ("data:", "https://", "http://")  # http: only where the router allows it (tests)


def add_request_arguments(cmd: argparse.ArgumentParser, *, sampling: bool, timeout_s: float) -> None:
    """The flags of `generate` (`sampling=True`) or `count`."""
    cmd.add_argument("prompt", help="the user's text, placed after the images")
    cmd.add_argument("--image", action="append", default=[], metavar="FILE", help="image file to send (repeatable)")
    cmd.add_argument(
        "--image-url",
        action="append",
        default=[],
        metavar="URL",
        type=_media_url,
        help="image as a data: or https:// URL, fetched by the router (repeatable)",
    )
    cmd.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="FILE",
        help="video file to send, MP4 or WebM/Matroska, placed after the images (repeatable)",
    )
    cmd.add_argument("--system", default="", metavar="TEXT", help="system message placed before the user turn")
    cmd.add_argument(
        "--address",
        default=DEFAULT_ROUTER,
        metavar="HOST:PORT",
        help=f"the router's gRPC address (default {DEFAULT_ROUTER})",
    )
    cmd.add_argument("--max-tokens", type=_positive_int, default=64, help="most tokens to generate (default 64)")
    cmd.add_argument(
        "--temperature", type=_non_negative_float, default=0.0, help="sampling temperature; 0 is greedy (default 0)"
    )
    cmd.add_argument("--cache-salt", default="", help="isolates prefix-cache sharing (e.g. per tenant)")
    cmd.add_argument(
        "--timeout",
        type=_positive_float,
        default=timeout_s,
        metavar="SECONDS",
        help=f"deadline of the whole call in seconds (default {timeout_s:g})",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text")
    cmd.add_argument(
        "--api-key",
        default=os.environ.get("EPD_API_KEY", ""),
        help="sent as 'authorization: Bearer <key>' (default: $EPD_API_KEY)",
    )
    cmd.add_argument(
        "--tls-ca-file",
        default="",
        metavar="PEM",
        help="connect over TLS, verifying the router's certificate with this CA",
    )
    if sampling:
        cmd.add_argument("--top-p", type=_unit_float, default=0.0, help="nucleus sampling mass in (0, 1]; 0 is off")
        cmd.add_argument("--top-k", type=_non_negative_int, default=0, help="sample among the k likeliest; 0 is off")
        cmd.add_argument("--seed", type=_non_negative_int, default=None, help="sampling seed for repeatable output")
        cmd.add_argument(
            "--stop", action="append", default=[], metavar="TEXT", help="stop when this text is generated (repeatable)"
        )


def build_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    """The GenerateRequest the flags describe: system turn, then images (files, URLs), then the prompt."""
    from services.client import user_request

    request = user_request(
        args.prompt,
        [read_image(Path(p)) for p in args.image],
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=getattr(args, "seed", None),
        stop=getattr(args, "stop", ()),
        cache_salt=args.cache_salt,
    )
    request.sampling.top_p = getattr(args, "top_p", 0.0)
    request.sampling.top_k = getattr(args, "top_k", 0)
    content = request.messages[0].content
    for index, url in enumerate(args.image_url):  # after the files, before the text part
        content.insert(len(args.image) + index, generation_pb2.ContentPart(image=generation_pb2.Media(url=url)))
    for index, path in enumerate(args.video):  # after the images, before the text part
        video = generation_pb2.Media(data=read_video(Path(path)))
        content.insert(len(args.image) + len(args.image_url) + index, generation_pb2.ContentPart(video=video))
    if args.system:
        system = generation_pb2.Message(role="system", content=[generation_pb2.ContentPart(text=args.system)])
        request.messages.insert(0, system)
    return request


def read_image(path: Path) -> bytes:
    """The file's bytes when it is there, readable and an image; else a usage error saying which."""
    data = _read_media(path, "image", IMAGE_KINDS)
    if sniff_format(data) is None:
        raise usage_error(f"image file {path} is not an image", f"give {IMAGE_KINDS}")
    return data


def read_video(path: Path) -> bytes:
    """The file's bytes when it is there, readable and in a video container epd reads (from its magic bytes
    only: the router checks the streams); else a usage error saying which."""
    data = _read_media(path, "video", VIDEO_KINDS)
    if sniff_container(data) is None:
        raise usage_error(f"video file {path} is not an MP4 or WebM/Matroska file", f"give {VIDEO_KINDS}")
    return data


def _read_media(path: Path, kind: str, kinds: str) -> bytes:
    """A media file's bytes, not empty; else a usage error naming ``kind`` and the file."""
    if not path.exists():
        raise usage_error(f"{kind} file {path} not found", f"give a path to an existing {kind}")
    if path.is_dir():
        raise usage_error(f"{kind} file {path} is a folder", f"give {kinds}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise usage_error(
            f"cannot read {kind} file {path}: {exc.strerror}", "check the path and its permissions"
        ) from None
    if not data:
        raise usage_error(f"{kind} file {path} is empty", f"give {kinds}")
    return data


def _client(args: argparse.Namespace):  # noqa: ANN202 (services.client imports grpc stubs: imported late)
    """The router client the flags describe: TLS with `--tls-ca-file`, the key with `--api-key`."""
    from services.client import Client

    credentials = None
    if args.tls_ca_file:
        credentials = grpc.ssl_channel_credentials(Path(args.tls_ca_file).read_bytes())
    return Client(args.address, credentials, args.api_key)


def generate(args: argparse.Namespace) -> int:
    """Stream the answer as text (after a token count), or print it as one JSON object with `--json`."""
    request = build_request(args)
    check_reachable(args.address)
    with _client(args) as client, rpc_errors(args.address, args.timeout):
        if not args.json:
            return print_answer(client, request, args.timeout)
        answer = client.generate(request, timeout_s=args.timeout)
    if answer.final is None:
        raise failure(f"the router at {args.address} ended the stream without a final message", "see its log")
    print(json.dumps(_answer_json(answer)))
    return 0


def count(args: argparse.Namespace) -> int:
    """Print the request's TokenCount, one field a line (or as JSON)."""
    request = build_request(args)
    check_reachable(args.address)
    with _client(args) as client, rpc_errors(args.address, args.timeout):
        result = client.count(request, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(_message_json(result)))
    else:
        print(
            f"text {result.text_tokens}\nimage {result.image_tokens}\nvideo {result.video_tokens}\n"
            f"prompt {result.prompt_tokens}\n"
            f"max_tokens {result.max_tokens}\nprojected {result.projected_tokens}\n"
            f"per item {list(result.tokens_per_item)}"
        )
    return 0


def print_answer(client: Any, request: generation_pb2.GenerateRequest, timeout_s: float) -> int:
    """Print the token count, the streamed text as it comes, then one summary line from the final message."""
    tokens = client.count(request, timeout_s=timeout_s)
    print(
        f"tokens: text {tokens.text_tokens}, image {tokens.image_tokens}, video {tokens.video_tokens}, "
        f"prompt {tokens.prompt_tokens}, "
        f"projected {tokens.projected_tokens}"
    )
    final = None
    try:
        for response in client.stream(request, timeout_s=timeout_s):
            if response.HasField("chunk"):
                print(response.chunk.text, end="", flush=True)
            else:
                final = response.final
    finally:
        print(flush=True)  # end the streamed line, also before an error line
    if final is None:
        raise failure("the router ended the stream without a final message", "see the router's log")
    usage = final.usage
    print(
        f"[{final.finish_reason}] prompt {usage.prompt_tokens} (text {usage.text_tokens}, image "
        f"{usage.image_tokens}, cached {usage.cached_tokens}), completion {usage.completion_tokens}, "
        f"first token {final.timing.first_token_s * 1000:.0f} ms, total {final.timing.total_s:.2f} s"
    )
    return 0


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connection to a `host:port` address within `timeout_s`; other gRPC targets are left to the call."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return
    except ConnectionRefusedError:
        problem = f"no router listens at {address}"
    except TimeoutError:
        problem = f"cannot reach the router at {address} within {timeout_s:g}s"
    except OSError as exc:
        problem = f"cannot reach the router at {address}: {exc.strerror or exc}"
    raise failure(problem, "start the cluster with `epd up`, or pass --address HOST:PORT of a running router")


@contextlib.contextmanager
def rpc_errors(address: str, timeout_s: float) -> Iterator[None]:
    """gRPC errors inside turned into one-line failures naming the status."""
    try:
        yield
    except grpc.RpcError as exc:
        raise _rpc_failure(exc, address, timeout_s) from None


def _rpc_failure(exc: grpc.RpcError, address: str, timeout_s: float) -> Exception:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or str(exc)
    status = f"{code.name}: {details}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return failure(f"the router at {address} is unavailable ({status})", "check that `epd up` is running there")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return failure(
            f"no answer from the router at {address} within {timeout_s:g}s ({status})", "pass a larger --timeout"
        )
    return failure(f"the router refused the request: {status}", "change the request as the message says")


def _answer_json(answer: Any) -> dict[str, Any]:
    final = answer.final
    return {
        "text": answer.text,
        "token_ids": list(answer.token_ids),
        "finish_reason": final.finish_reason,
        "usage": _message_json(final.usage),
        "timing": _message_json(final.timing),
        "request_id": final.request_id,
    }


def _message_json(message: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _media_url(text: str) -> str:
    if not text.startswith(URL_SCHEMES):
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not a data: or https:// URL (for a local file use --image)")
    return text


def _number(kind: type, test: Any, wanted: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"{text} is not {wanted}")
        return value

    parse.__name__ = wanted  # argparse names the type in some messages
    return parse


_positive_int = _number(int, lambda v: v > 0, "a whole number above 0")
_non_negative_int = _number(int, lambda v: v >= 0, "a whole number >= 0")
_positive_float = _number(float, lambda v: v > 0, "a number above 0")
_non_negative_float = _number(float, lambda v: v >= 0, "a number >= 0")
_unit_float = _number(float, lambda v: 0 <= v <= 1, "a number from 0 to 1")
