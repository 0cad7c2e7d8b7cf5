"""A TCP proxy that can stall: a connection that hangs without closing, for tests.

A broker or a store that stops answering while its TCP connection stays open (a network
partition, a frozen server, a full switch buffer) is the hardest failure for a client: nothing
is refused, nothing is closed, every call just waits. Put :class:`TcpProxy` between your
consumer and a real server, then stall it::

    with TcpProxy("127.0.0.1", 4222) as proxy:
        adapter = NatsJetStreamAdapter(f"nats://127.0.0.1:{proxy.port}")
        ...
        proxy.stall(10.0)              # no byte moves either way for 10 s; nothing is closed
        proxy.resumed.wait()           # (or poll proxy.stalled)
        ...                            # the consumer must be handling again soon after

While stalled the proxy still accepts connections (and connects them to the server), but
forwards nothing in either direction until it resumes; then whatever was held back flows on,
late, as it would after a real stall. The proxy runs its own event loop in a daemon thread, so
it is driven the same way from sync code, from any event loop and from other processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import TracebackType

# Bytes read from one side before they are written to the other.
CHUNK = 65536
# Seconds start() and close() wait for the proxy's thread.
THREAD_TIMEOUT = 10.0


class TcpProxy:
    """Forwards connections from a free loopback port to ``host:port``, and can stall them.

    Args:
        host: the server's address.
        port: the server's port.
        listen_port: the port to listen on (default: a free one, in :attr:`port`).
    """

    def __init__(self, host: str, port: int, *, listen_port: int = 0) -> None:
        self.host = host
        self.target_port = port
        self.port = listen_port
        self.resumed = threading.Event()
        """Set while bytes flow (from the start, and again when a stall ends)."""
        self.resumed.set()
        self.resumed_at: float | None = None
        """``time.monotonic()`` when the last stall ended (None before any)."""
        self.connections = 0
        """Connections accepted so far."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._streams: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._resume_handle: asyncio.TimerHandle | None = None

    @property
    def stalled(self) -> bool:
        """Whether the proxy holds every byte back now."""
        return not self.resumed.is_set()

    def start(self) -> TcpProxy:
        """Listen (on :attr:`port`) and forward; returns once connections are accepted."""
        if self._thread is not None:
            raise RuntimeError("TcpProxy.start: already started")
        loop = asyncio.new_event_loop()
        listening = asyncio.run_coroutine_threadsafe(self._listen(), loop)
        self._thread = threading.Thread(target=loop.run_forever, name="tcp-proxy", daemon=True)
        self._loop = loop
        self._thread.start()
        listening.result(THREAD_TIMEOUT)
        return self

    def stall(self, seconds: float | None = None) -> None:
        """Stop forwarding in both directions, without closing anything; resume by itself
        after ``seconds`` (None: only when :meth:`resume` is called)."""
        if seconds is not None and not seconds > 0:
            raise ValueError(f"TcpProxy.stall: seconds must be > 0 or None, got {seconds!r}")
        self.resumed.clear()
        self._call(self._stall, seconds)

    def resume(self) -> None:
        """Forward again; what was held back flows on."""
        self._call(self._resume)

    def close(self) -> None:
        """Stop listening, close every connection and stop the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shut(), loop).result(THREAD_TIMEOUT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(THREAD_TIMEOUT)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- on the proxy's loop --------------------------------------------------------------

    def _call(self, function: object, *args: object) -> None:
        if self._loop is None:
            raise RuntimeError("TcpProxy is not started")
        self._loop.call_soon_threadsafe(function, *args)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def _stall(self, seconds: float | None) -> None:
        assert self._flowing is not None and self._loop is not None
        self._flowing.clear()
        if self._resume_handle is not None:
            self._resume_handle.cancel()
        self._resume_handle = (
            None if seconds is None else self._loop.call_later(seconds, self._resume))

    def _resume(self) -> None:
        assert self._flowing is not None
        if self._resume_handle is not None:
            self._resume_handle.cancel()
            self._resume_handle = None
        if not self._flowing.is_set():
            self.resumed_at = time.monotonic()
        self._flowing.set()
        self.resumed.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        self._streams.add(writer)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                self.host, self.target_port)
        except OSError:
            writer.close()
            self._streams.discard(writer)
            return
        self._streams.add(upstream_writer)
        # cancelled by close(): end quietly (asyncio logs a connection handler's cancellation)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._pipe(reader, upstream_writer),
                                 self._pipe(upstream_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self._flowing.wait()  # read just before a stall: held back too
                writer.write(data)
                await writer.drain()
        finally:
            # one side closed (or failed): close the other, as a TCP proxy does
            self._streams.discard(writer)
            writer.close()

    async def _shut(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._streams):
            writer.close()
        self._streams.clear()
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


__all__ = ["TcpProxy"]
