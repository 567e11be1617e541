"""The cluster key: ZeroMQ CURVE (encryption and authentication) on every TCP socket between processes that are
not on one host's IPC — the sockets between nodes (--nnodes > 1) and a TCP --rpc-addr.

Every node holds the same key file (`loraplex keygen PATH`, mode 0600), one CURVE key pair. A binding socket is the
CURVE server with the pair's secret half; a connecting socket is a CURVE client that expects that server key and
presents the pair itself. The server's ZAP handler admits only clients presenting the cluster's public key, which
the CURVE handshake only lets a holder of the secret half do, so a peer without the file gets no message through,
in either direction. Every refused handshake is logged (a socket monitor per binding socket sees both a wrong key,
which fails the handshake before ZAP is asked, and a ZAP denial), at most once per REFUSAL_LOG_INTERVAL_S. IPC and
inproc sockets stay plain: they never leave the host, and the file system guards them.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger("loraplex.curve")

_REFUSALS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_MONITOR_STOPPED)
REFUSAL_LOG_INTERVAL_S = 10.0
_monitor_ids = itertools.count()
_authenticators: dict[int, ThreadAuthenticator] = {}  # by the libzmq context they serve: one ZAP handler each
_REASONS = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
            zmq.EVENT_HANDSHAKE_FAILED_AUTH: "denied by ZAP"}
_authenticators_lock = threading.Lock()


class ClusterKeyError(ValueError):
    pass


def write_key_file(path: str) -> None:
    """A new cluster key pair at `path`, readable by its owner only; never overwrites a file."""
    if not zmq.has("curve"):
        raise ClusterKeyError("this libzmq has no CURVE support")
    public, secret = zmq.curve_keypair()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as e:
        raise ClusterKeyError(f"{path} exists: a key file is never overwritten") from e
    with os.fdopen(fd, "w") as file:  # ZeroMQ's certificate format: zmq.auth.load_certificate reads it
        file.write("#   loraplex cluster key (ZeroMQ CURVE): the same file on every node; keep it secret\n"
                   "metadata\ncurve\n"
                   f'    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n')


class ClusterKey:
    """The cluster's CURVE key pair, as loaded from its file."""

    def __init__(self, public: bytes, secret: bytes):
        self.public = public  # z85
        self.secret = secret

    @classmethod
    def load(cls, path: str) -> ClusterKey:
        """ClusterKeyError, in one line, if the file is missing, open to others or not a key file."""
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            raise ClusterKeyError(f"--cluster-key-file {path}: {e.strerror}") from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ClusterKeyError(f"--cluster-key-file {path} is readable by others (mode {stat.S_IMODE(mode):o}): "
                                  "chmod 600 it")
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise ClusterKeyError(f"--cluster-key-file {path}: not a key file ({e})") from e
        if not public or not secret:
            raise ClusterKeyError(f"--cluster-key-file {path}: no secret key in it (write one with loraplex keygen)")
        return cls(public, secret)

    @classmethod
    def of(cls, key_file: str | None) -> ClusterKey | None:
        """--cluster-key-file's key, or None without one."""
        return cls.load(key_file) if key_file else None

    def secure(self, sock: zmq.Socket, addr: str, bind: bool) -> None:
        """Set CURVE on a TCP socket before it binds or connects; other transports stay as they are."""
        if not addr.startswith("tcp://"):
            return
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        if bind:
            self._admit_in(sock.context)
            sock.curve_server = True
            sock.zap_domain = self.zap_domain.encode()
            _watch_refusals(sock)
        else:
            sock.curve_serverkey = self.public

    @property
    def zap_domain(self) -> str:
        # one ZAP domain per key: sockets of one process bound with different keys (tests) admit only their own
        return "loraplex-" + self.public.decode()

    def _admit_in(self, ctx: zmq.Context) -> None:
        """The context's ZAP handler (started once per context) admits this key's holders in its domain."""
        with _authenticators_lock:
            auth = _authenticators.get(ctx.underlying)
            if auth is None:
                auth = _authenticators[ctx.underlying] = ThreadAuthenticator(ctx, log=logging.getLogger("loraplex.zap"))
                auth.start()
            auth.configure_curve_callback(self.zap_domain, _OnlyClusterKey(self.public))


class _OnlyClusterKey:
    """The ZAP handler's rule: a client must present the cluster's public key."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self.public:
            return True
        # the socket's monitor logs the refusal (rate-limited); the key it presented only at debug level
        logger.debug("ZAP: unknown CURVE client key %s", client_key.decode(errors="replace"))
        return False


def _watch_refusals(sock: zmq.Socket) -> None:
    """Log the handshakes the socket refuses (wrong key, no key, a plaintext peer), from a daemon thread."""
    endpoint = f"inproc://loraplex-curve-monitor-{os.getpid()}-{next(_monitor_ids)}"
    sock.monitor(endpoint, _REFUSALS)
    pair = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
    pair.connect(endpoint)
    threading.Thread(target=_log_refusals, args=(pair,), name="curve-monitor", daemon=True).start()


def _log_refusals(pair: zmq.Socket) -> None:
    # A refused peer reconnects every 100 ms or so: the first refusal is logged, then one line per
    # REFUSAL_LOG_INTERVAL_S with the count since.
    logged_at, unlogged = -REFUSAL_LOG_INTERVAL_S, 0
    try:
        while True:
            event = parse_monitor_message(pair.recv_multipart())
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            unlogged += 1
            if time.monotonic() - logged_at < REFUSAL_LOG_INTERVAL_S:
                continue
            logger.warning("refused %d peer connection(s) on %s: CURVE handshake failed (%s, %#x): the peer lacks "
                           "the --cluster-key-file key", unlogged, event["endpoint"].decode(errors="replace"),
                           _REASONS.get(event["event"], "?"), event["value"])
            logged_at, unlogged = time.monotonic(), 0
    except zmq.ZMQError:  # the context is ending with the process
        return
    finally:
        pair.close(linger=0)
