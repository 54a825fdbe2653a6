"""The store as a prefix in an S3 (or S3-compatible) bucket, through boto3 and the standard AWS
credential chain."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlparse

from dflash_assets.storage.store import (
    CHECKSUM_MODES,
    STORE_URL_SETTING,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StoreConfigError,
    StoreError,
    TransientStoreError,
    check_key,
    check_object_size,
    check_prefix,
    partial_path,
)

log = logging.getLogger(__name__)


@dataclass
class S3Settings:
    """How to reach S3. Credentials are deliberately absent: they come from the standard AWS chain
    (environment, profile, instance role), so they never end up in run config or process arguments."""

    endpoint_url: str | None = None  # None: boto3 reads AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL itself
    region: str | None = None  # None: AWS_DEFAULT_REGION / profile
    profile: str | None = None  # None: AWS_PROFILE / default chain
    checksum: str | None = None  # "when_supported" / "when_required"; None: boto3 default (env honoured)
    max_pool_connections: int = 100
    max_attempts: int = 8  # per request, including the first try (botocore's adaptive retry mode)
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    # None: path-style for custom endpoints (S3-compatible servers rarely have wildcard DNS), boto3's
    # default for AWS itself. "path" / "virtual" / "auto" force a style.
    addressing_style: str | None = None
    # Sized for hidden-state objects of ~100 MB (5 layers x 5120 x bf16 x ~2,000 tokens): each is one
    # PUT and one GET, never a multipart upload's four requests or a ranged download's several; their
    # parallelism comes from many objects in flight (the uploader's workers, the training feed's reads).
    # Only larger files (checkpoints, exports) go in parts of `multipart_chunk_bytes`, at most
    # `transfer_concurrency` parts in flight over the store's one transfer manager, both directions.
    multipart_threshold_bytes: int = 128 * 2**20
    multipart_chunk_bytes: int = 32 * 2**20
    transfer_concurrency: int = 8
    list_page_size: int = 1000

    def __post_init__(self) -> None:
        if self.checksum is not None and self.checksum not in CHECKSUM_MODES:
            raise StoreConfigError(
                f"S3 checksum mode {self.checksum!r} is not one of {CHECKSUM_MODES} "
                "(or None for boto3's default, which honours AWS_REQUEST_CHECKSUM_CALCULATION)"
            )
        if self.addressing_style not in (None, "path", "virtual", "auto"):
            raise StoreConfigError(
                f"S3 addressing style {self.addressing_style!r} is not one of 'path', 'virtual', 'auto'"
            )
        if self.max_attempts < 1 or self.max_pool_connections < 1 or self.list_page_size < 1:
            raise StoreConfigError("S3 max_attempts, max_pool_connections and list_page_size must be >= 1")


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix), or a `StoreConfigError` naming the setting."""
    parsed = urlparse(url)
    bucket = parsed.netloc
    if parsed.scheme != "s3" or not bucket or parsed.query or parsed.fragment:
        raise StoreConfigError(
            f"store URL {url!r} is not of the form s3://<bucket>/<prefix>: fix {STORE_URL_SETTING}"
        )
    prefix = parsed.path.strip("/")
    if prefix:
        try:
            check_prefix(prefix)
        except ValueError as err:
            raise StoreConfigError(f"store URL {url!r}: {err}; fix {STORE_URL_SETTING}") from None
    return bucket, prefix


def _is_aws_endpoint(endpoint_url: str) -> bool:
    host = urlparse(endpoint_url).hostname or ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn", ".api.aws"))


# botocore's data loader, one a data path (AWS_DATA_PATH) for the whole process. A session reads and
# parses S3's service model, endpoint rules and partitions through its loader, which keeps them; with a
# loader of its own, every store (a process opens one a range, an uploader, a check) parsed them again:
# 0.2 s of CPU a store, most of what opening one costs.
_LOADERS: dict[str | None, Any] = {}
_LOADERS_LOCK = threading.Lock()


def _session(profile: str | None, region: str | None) -> Any:
    """A boto3 session of `profile` (None: the standard chain's) and `region`, on the process's loader."""
    import boto3
    import botocore.loaders
    import botocore.session

    core = botocore.session.Session(profile=profile)
    data_path = core.get_config_variable("data_path")  # names a missing profile (ProfileNotFound)
    with _LOADERS_LOCK:
        loader = _LOADERS.get(data_path)
        if loader is None:
            loader = _LOADERS[data_path] = botocore.loaders.create_loader(data_path)
        core.register_component("data_loader", loader)
        session = boto3.session.Session(botocore_session=core, region_name=region)
        # boto3 adds its own data folder to the loader's search paths, once a session: keep one of each.
        loader.search_paths[:] = list(dict.fromkeys(loader.search_paths))
    return session


class S3Store(ObjectStore):
    """A prefix in an S3 (or S3-compatible) bucket, through boto3 and the standard credential chain."""

    def __init__(self, url: str, settings: S3Settings | None = None):
        from boto3.s3.transfer import TransferConfig

        self.settings = settings or S3Settings()
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        try:
            self._session = _session(self.settings.profile, self.settings.region)
        except Exception as err:  # botocore's ProfileNotFound and friends
            raise StoreConfigError(
                f"cannot set up AWS session for {self.url}: {type(err).__name__}: {err}; "
                "check AWS_PROFILE / S3Settings.profile and AWS_CONFIG_FILE"
            ) from None
        self._client = self._make_client(
            max_attempts=self.settings.max_attempts,
            connect_timeout_s=self.settings.connect_timeout_s,
            read_timeout_s=self.settings.read_timeout_s,
        )
        self.endpoint_url: str = self._client.meta.endpoint_url
        self.region: str | None = self._client.meta.region_name
        self._transfer_config = TransferConfig(
            multipart_threshold=self.settings.multipart_threshold_bytes,
            multipart_chunksize=self.settings.multipart_chunk_bytes,
            max_concurrency=self.settings.transfer_concurrency,
            use_threads=self.settings.transfer_concurrency > 1,
        )
        # One transfer manager for every large file, made when the first one comes: a manager per
        # call (boto3's upload_file / download_file) costs a thread pool and milliseconds of CPU each.
        self._transfers: Any = None
        self._transfers_lock = threading.Lock()

    def _make_client(self, *, max_attempts: int, connect_timeout_s: float, read_timeout_s: float) -> Any:
        from botocore.config import Config

        def build(addressing_style: str | None) -> Any:
            config = Config(
                # total_max_attempts counts the first try; botocore's "max_attempts" key would mean retries.
                retries={"mode": "adaptive", "total_max_attempts": max_attempts},
                max_pool_connections=self.settings.max_pool_connections,
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                request_checksum_calculation=self.settings.checksum,
                response_checksum_validation=self.settings.checksum,
                s3={"addressing_style": addressing_style} if addressing_style else None,
            )
            return self._session.client("s3", endpoint_url=self.settings.endpoint_url, config=config)

        style = self.settings.addressing_style
        client = build(style)
        if style is None and not _is_aws_endpoint(client.meta.endpoint_url):
            # The endpoint may come from AWS_ENDPOINT_URL_S3 or a profile, which only boto3 resolves,
            # so look at the resolved one before choosing path-style.
            client = build("path")
        return client

    def count_requests(self) -> dict[str, int]:
        """A live count, by HTTP method, of the requests this store sends from now on (attempts
        included): what a benchmark reports as requests an object."""
        counts: dict[str, int] = {}
        lock = threading.Lock()

        def count(request: Any, **kwargs: Any) -> None:
            with lock:
                counts[request.method] = counts.get(request.method, 0) + 1

        self._client.meta.events.register("before-send.s3", count)
        return counts

    @property
    def description(self) -> str:
        return f"{self.url} (endpoint {self.endpoint_url})"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _relative(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def uri(self, key: str) -> str:
        # Also accepts a prefix ("hidden-states/p/"), since messages name partitions as well as objects.
        return "s3://" + "/".join(p for p in (self.bucket, self.prefix, check_prefix(key)) if p)

    # -- errors

    def _redact(self, text: str) -> str:
        # Servers echo request details in error bodies; make sure no credential ever reaches a message.
        try:
            credentials = self._session.get_credentials()
            frozen = credentials.get_frozen_credentials() if credentials else None
        except Exception:
            frozen = None
        if frozen:
            # Key ids are not secret, and short test ids ("testing") would mangle bucket names.
            key_id = frozen.access_key if frozen.access_key and len(frozen.access_key) >= 16 else None
            for secret in (frozen.secret_key, frozen.token, key_id):
                if secret:
                    text = text.replace(secret, "***")
        return text

    def _raise(self, err: BaseException, action: str, key: str | None, *, checking: bool = False) -> NoReturn:
        """Turn a boto/botocore error into a StoreError whose message says what to fix."""
        from botocore import exceptions as bx

        what = f"{action} {key!r} in {self.url}" if key is not None else f"{action} {self.url}"
        where = f"endpoint {self.endpoint_url}"
        # s3transfer wraps ClientErrors (S3UploadFailedError); look underneath for the real cause.
        cause: BaseException = err
        while not isinstance(cause, (bx.ClientError, bx.BotoCoreError)) and cause.__context__ is not None:
            cause = cause.__context__
        detail = self._redact(f"{type(cause).__name__}: {cause}")

        if isinstance(cause, bx.NoCredentialsError | bx.PartialCredentialsError):
            raise StoreConfigError(
                f"cannot {what}: no AWS credentials found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or AWS_PROFILE, or run with an instance/container role"
            ) from None
        if isinstance(cause, bx.EndpointConnectionError | bx.ConnectTimeoutError | bx.ProxyConnectionError):
            message = (
                f"cannot {what}: S3 endpoint {self.endpoint_url} is unreachable ({detail}). "
                "Check AWS_ENDPOINT_URL_S3 (or S3Settings.endpoint_url) and that the server is up"
            )
            raise (StoreConfigError if checking else TransientStoreError)(message) from None
        if isinstance(cause, bx.ClientError):
            error = cause.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchBucket",) or (checking and code in ("404", "NotFound")):
                raise StoreConfigError(
                    f"cannot {what}: bucket {self.bucket!r} does not exist at {where}. "
                    f"Create it or fix {STORE_URL_SETTING} (now {self.url!r})"
                ) from None
            if code in ("NoSuchKey", "404", "NotFound"):
                raise ObjectNotFound(f"object {key!r} not found in {self.description}") from None
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken") or (
                status == 403 or code in ("403", "AccessDenied", "Forbidden")
            ):
                raise StoreConfigError(
                    f"cannot {what}: credentials rejected by {where} ({detail}). Check AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY / AWS_PROFILE, and that they may access bucket "
                    f"{self.bucket!r}"
                ) from None
            if code in (
                "PermanentRedirect",
                "301",
                "AuthorizationHeaderMalformed",
                "IllegalLocationConstraint",
            ):
                raise StoreConfigError(
                    f"cannot {what}: bucket {self.bucket!r} is in another region than {self.region!r} "
                    f"({detail}). Set AWS_DEFAULT_REGION (or S3Settings.region)"
                ) from None
            if code in ("InvalidRequest", "NotImplemented", "BadDigest", "XAmzContentSHA256Mismatch") and (
                "checksum" in detail.lower() or "chunk" in detail.lower() or code != "InvalidRequest"
            ):
                raise StoreError(
                    f"cannot {what}: {where} rejected the request's checksum/encoding ({detail}). "
                    "S3-compatible servers without flexible checksums need "
                    "AWS_REQUEST_CHECKSUM_CALCULATION=when_required (or S3Settings.checksum)"
                ) from None
            transient = (status is not None and status >= 500) or code in (
                "SlowDown",
                "Throttling",
                "ThrottlingException",
                "RequestTimeout",
                "RequestTimeTooSkewed",
                "InternalError",
                "ServiceUnavailable",
            )
            raise (TransientStoreError if transient else StoreError)(
                f"cannot {what} at {where}: {detail}"
            ) from None
        if isinstance(cause, bx.BotoCoreError):
            # Dropped connections, read timeouts, truncated bodies: worth retrying.
            # A checksum that does not match what was sent is a transfer damaged on the way.
            transient = isinstance(
                cause,
                bx.ConnectionError
                | bx.HTTPClientError
                | bx.IncompleteReadError
                | bx.ResponseStreamingError
                | bx.FlexibleChecksumError,
            )
            raise (TransientStoreError if transient else StoreError)(
                f"cannot {what} at {where}: {detail}"
            ) from None
        raise err

    @contextlib.contextmanager
    def _errors(self, action: str, key: str | None = None, *, checking: bool = False) -> Iterator[None]:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ClientError, BotoCoreError, Boto3Error) as err:
            self._raise(err, action, key, checking=checking)

    # -- operations

    def check(self) -> None:
        # A separate fail-fast client: few attempts and a short connect timeout, so a wrong endpoint
        # is reported in seconds instead of after the full retry budget.
        client = self._make_client(
            max_attempts=2,
            connect_timeout_s=min(self.settings.connect_timeout_s, 3.0),
            read_timeout_s=min(self.settings.read_timeout_s, 10.0),
        )
        with self._errors("check bucket of", checking=True):
            client.head_bucket(Bucket=self.bucket)

    def _transfer_manager(self) -> Any:
        from boto3.s3.transfer import create_transfer_manager

        with self._transfers_lock:
            if self._transfers is None:
                self._transfers = create_transfer_manager(self._client, self._transfer_config)
            return self._transfers

    def put_file(self, key: str, path: Path) -> ObjectInfo:
        full_key = self._key(key)
        size = os.path.getsize(path)
        with self._errors("upload", key):
            if size < self.settings.multipart_threshold_bytes:
                # One PUT, whose success answer is the confirmation: S3 reads after a write see it.
                with open(path, "rb") as body:
                    response = self._client.put_object(Bucket=self.bucket, Key=full_key, Body=body)
                return ObjectInfo(key, size, _etag(response.get("ETag")))
            # In parts; CompleteMultipartUpload's success (inside result()) is the confirmation.
            self._transfer_manager().upload(str(path), self.bucket, full_key).result()
        return ObjectInfo(key, size)

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        full_key = self._key(key)
        with self._errors("upload", key):
            response = self._client.put_object(Bucket=self.bucket, Key=full_key, Body=data)
        return ObjectInfo(key, len(data), _etag(response.get("ETag")))

    def get_bytes(self, key: str, size: int | None = None) -> bytes | bytearray:
        if size is not None and size >= self.settings.multipart_threshold_bytes:
            return self._get_ranged(key, size)
        with self._errors("download", key):
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            check_object_size(self, key, size, int(response["ContentLength"]))
            # Reading to the end checks the length and, where the object has one, its checksum.
            return response["Body"].read()

    def _get_ranged(self, key: str, size: int) -> bytearray:
        """A large object (an 8 K-token sample at a 27B target's width is ~480 MiB) in ranged GETs of
        `multipart_chunk_bytes`, `transfer_concurrency` at once, each part written in place into one
        buffer of the object's size: its bytes are in memory once, never joined from pieces, and one
        object reads at several connections' rate. Every part must come from the same version of the
        object (one ETag) and cover its range exactly."""
        buffer = bytearray(size)
        view = memoryview(buffer)
        chunk = self.settings.multipart_chunk_bytes
        full_key = self._key(key)

        def part(start: int) -> str | None:
            end = min(size, start + chunk) - 1
            response = self._client.get_object(Bucket=self.bucket, Key=full_key, Range=f"bytes={start}-{end}")
            total = str(response.get("ContentRange", "")).rpartition("/")[2]
            if not total.isdigit():
                raise StoreError(
                    f"{self.description} answered a ranged GET of {key!r} without a Content-Range: it does "
                    "not serve byte ranges"
                )
            check_object_size(self, key, size, int(total))
            at = start
            for piece in response["Body"].iter_chunks(_RANGE_READ_BYTES):
                if at + len(piece) > end + 1:
                    break
                view[at : at + len(piece)] = piece
                at += len(piece)
            if at != end + 1:
                raise TransientStoreError(
                    f"ranged read of {key!r} from {self.description} got bytes {start}-{at - 1}, expected "
                    f"{start}-{end}"
                )
            return _etag(response.get("ETag"))

        with (
            self._errors("download", key),
            ThreadPoolExecutor(self.settings.transfer_concurrency, thread_name_prefix="s3-range") as parts,
        ):
            etags = set(parts.map(part, range(0, size, chunk)))
        if len(etags) > 1:
            raise TransientStoreError(f"{key!r} in {self.description} changed while it was read in parts")
        return buffer

    def download(self, key: str, path: Path, size: int | None = None) -> Path:
        path = Path(path)
        if size is None:
            remote = self.head(key)
            if remote is None:
                raise ObjectNotFound(f"object {key!r} not found in {self.description}")
            size = remote.size
        if path.is_file() and path.stat().st_size == size:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(path)
        try:
            with self._errors("download", key):
                if size < self.settings.multipart_threshold_bytes:
                    self._get_to_file(key, size, partial)
                else:
                    # Ranged GETs, their size given so the transfer manager sends no HEAD of its own.
                    self._transfer_manager().download(
                        self.bucket, self._key(key), str(partial), subscribers=[_KnownSize(size)]
                    ).result()
            got = partial.stat().st_size
            if got != size:
                raise TransientStoreError(
                    f"download of {key!r} from {self.description} got {got} bytes, expected {size}"
                )
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return path

    def _get_to_file(self, key: str, size: int, path: Path) -> None:
        """One GET streamed into `path`; the last (empty) read checks the length and any checksum."""
        response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
        check_object_size(self, key, size, int(response["ContentLength"]))
        with open(path, "wb") as file:
            for chunk in response["Body"].iter_chunks(_READ_CHUNK_BYTES):
                file.write(chunk)

    def head(self, key: str) -> ObjectInfo | None:
        full_key = self._key(key)
        try:
            with self._errors("look up", key):
                response = self._client.head_object(Bucket=self.bucket, Key=full_key)
        except ObjectNotFound:
            return None
        return ObjectInfo(key, int(response["ContentLength"]), _etag(response.get("ETag")))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=full_prefix,
            PaginationConfig={"PageSize": self.settings.list_page_size},
        )
        with self._errors("list", prefix):
            for page in pages:
                for item in page.get("Contents", ()):
                    yield ObjectInfo(self._relative(item["Key"]), int(item["Size"]), _etag(item.get("ETag")))

    def delete(self, key: str) -> None:
        full_key = self._key(key)
        with self._errors("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=full_key)

    def _delete_listed(self, prefix: str) -> int:
        deleted = 0
        batch: list[str] = []

        def flush() -> None:
            nonlocal deleted
            with self._errors("delete objects under", prefix):
                response = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise StoreError(
                    f"could not delete {len(errors)} of {len(batch)} objects under {prefix!r} in "
                    f"{self.description}; first: {first.get('Key')!r}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )
            deleted += len(batch)
            batch.clear()

        for info in self.list(prefix):
            batch.append(self._key(info.key))
            if len(batch) == 1000:  # DeleteObjects' per-request limit
                flush()
        if batch:
            flush()
        return deleted


def _etag(value: str | None) -> str | None:
    return value.strip('"') if value else None


_READ_CHUNK_BYTES = 8 * 2**20
# A ranged part is copied into its place in pieces this size: what a part in flight holds beside the buffer.
_RANGE_READ_BYTES = 2**20


class _KnownSize:
    """A transfer subscriber telling the transfer manager an object's size (from a manifest), which it
    would otherwise send a HEAD for."""

    def __init__(self, size: int) -> None:
        self._size = size

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self._size)
