"""In-region check: warn once when the checkpoint bucket lives in another region than the instance.

A resume pulls the whole checkpoint; across regions that is slower (and billed as transfer), so a
98 GB checkpoint can add minutes to every resume. At start the writer asks, off the training thread:

- the **instance's region**, from the cloud's metadata service, through the lookup each cloud's
  module of :mod:`spot_callbacks.preemption` has (same endpoints and variables as its notices,
  ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``, ``$GCE_METADATA_HOST``, ``$SPOT_AZURE_METADATA_ENDPOINT``)
  and the short detection timeout: AWS IMDSv2 ``placement/region``, GCP ``instance/zone``
  (``us-central1-a`` -> ``us-central1``), Azure IMDS ``compute/location``;
- the **bucket's region**: S3 ``GetBucketLocation``, the GCS bucket's ``location``. Azure's
  data plane does not tell a storage account's location, so an ``az://`` store is never compared.

Off-cloud, without permission, or when either answer is unknown, nothing is said. The warning is
logged at the next step boundary (:meth:`RegionCheck.warn_once`), so that it can use the size and
pull speed of a checkpoint this run has just resumed from. ``$SPOT_REGION_CHECK=0`` turns it off.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import spot_callbacks.settings as settings
from spot_callbacks._format import format_seconds
from spot_callbacks.preemption.clouds import CLOUDS, ask_each
from spot_callbacks.preemption.metadata import DETECT_TIMEOUT_S
from spot_callbacks.store.backends import backend_of_fs, load

log = logging.getLogger("spot_callbacks")

# Used when this run measured no pull: a single client reading from another region typically gets
# well under its in-region throughput. An assumption, stated as such in the warning.
ASSUMED_CROSS_REGION_BYTES_PER_S = 100e6
# A pull shorter than this measures latency or a local copy that was reused, not bandwidth.
MIN_MEASURED_PULL_S = 1.0
# The regions of GCS's predefined dual-regions (https://cloud.google.com/storage/docs/locations).
GCS_DUAL_REGIONS = {
    "asia1": ("asia-northeast1", "asia-northeast2"),
    "eur4": ("europe-north1", "europe-west4"),
    "eur5": ("europe-west1", "europe-west2"),
    "eur7": ("europe-west3", "europe-west10"),
    "eur8": ("europe-west3", "europe-west6"),
    "nam4": ("us-central1", "us-east1"),
}
# GCS multi-regions: every region whose name starts with one of these prefixes is inside.
GCS_MULTI_REGIONS = {"us": ("us-",), "eu": ("europe-",), "asia": ("asia-",)}


@dataclass(frozen=True)
class Placement:
    """Where something runs or is stored: the cloud (``aws``, ``gcp``, ``azure``) and its region name(s)."""

    cloud: str
    region: str
    regions: tuple[str, ...] = ()  # a GCS dual- or multi-region: the regions (or prefixes) inside it

    def contains(self, other: Placement) -> bool:
        """Whether ``other`` (an instance) sits in this placement (a bucket).

        Example:
            >>> Placement("gcp", "nam4", ("us-central1", "us-east1")).contains(Placement("gcp", "us-east1"))
            True
            >>> Placement("aws", "eu-west-1").contains(Placement("aws", "us-east-1"))
            False
        """
        if self.cloud != other.cloud:
            return False
        if self.region == other.region:
            return True
        return any(
            other.region == r or (r.endswith("-") and other.region.startswith(r)) for r in self.regions
        )

    def describe(self) -> str:
        return f"{self.cloud} {self.region}"


# ------------------------------------------------------------------ instance


def instance_placement(timeout_s: float = DETECT_TIMEOUT_S) -> Placement | None:
    """The cloud and region this machine runs in; None off-cloud (each service asked once, ``timeout_s`` each)."""
    services = (cloud(request_timeout_s=timeout_s) for cloud in CLOUDS.values())
    for service, region in ask_each(services, lambda service: service.region(timeout_s)):
        if region:
            return Placement(service.name, region.lower())
    return None


# -------------------------------------------------------------------- bucket


def s3_location(constraint: str | None) -> str:
    """The region of a ``GetBucketLocation`` answer: none is us-east-1, the legacy ``EU`` is eu-west-1.

    Example:
        >>> s3_location(None), s3_location("EU"), s3_location("eu-central-1")
        ('us-east-1', 'eu-west-1', 'eu-central-1')
    """
    if not constraint:
        return "us-east-1"
    return "eu-west-1" if constraint == "EU" else constraint


def gcs_placement(bucket: dict[str, Any]) -> Placement | None:
    """Where a GCS bucket's resource (``storage/v1/b/<name>``) says it stores data.

    Example:
        >>> gcs_placement({"location": "US-EAST1", "locationType": "region"})
        Placement(cloud='gcp', region='us-east1', regions=())
        >>> gcs_placement({"location": "US", "locationType": "multi-region"}).contains(Placement("gcp", "us-west1"))
        True
    """
    location = str(bucket.get("location") or "").lower()
    if not location:
        return None
    data_locations = (bucket.get("customPlacementConfig") or {}).get("dataLocations")
    if isinstance(data_locations, list) and data_locations:
        return Placement("gcp", location, tuple(str(r).lower() for r in data_locations))
    if location in GCS_DUAL_REGIONS:
        return Placement("gcp", location, GCS_DUAL_REGIONS[location])
    if location in GCS_MULTI_REGIONS:
        return Placement("gcp", location, GCS_MULTI_REGIONS[location])
    return Placement("gcp", location)


def s3_bucket_placement(fs: Any, bucket: str) -> Placement | None:
    """S3 ``GetBucketLocation`` of ``bucket`` through s3fs (the backend table's lookup for ``s3``)."""
    if not hasattr(fs, "call_s3"):
        return None
    answer = fs.call_s3("get_bucket_location", Bucket=bucket)
    return Placement("aws", s3_location(answer.get("LocationConstraint")))


def gcs_bucket_placement(fs: Any, bucket: str) -> Placement | None:
    """The GCS bucket resource of ``bucket`` through gcsfs (the backend table's lookup for ``gs``)."""
    if not hasattr(fs, "call"):
        return None
    answer = fs.call("GET", "b/{}", bucket, json_out=True)
    return gcs_placement(answer if isinstance(answer, dict) else json.loads(answer))


def bucket_placement(fs: Any, path: str) -> Placement | None:
    """The region of the bucket holding ``path`` on ``fs``, by its backend's lookup in the backend
    table (:mod:`spot_callbacks.store.backends`); None when unknown, not allowed or not told."""
    lookup = backend_of_fs(fs).bucket_region
    if lookup is None:
        return None
    placement: Placement | None = load(lookup)(fs, path.split("/", 1)[0])
    return placement


def _endpoint(fs: Any) -> str | None:
    """A custom S3/GCS endpoint (an S3-compatible service, an emulator), which may not be that cloud."""
    options = getattr(fs, "storage_options", {}) or {}
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    if not endpoint:
        return None
    parts = urlsplit(str(endpoint))
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"  # no user:password@


# --------------------------------------------------------------------- check


@dataclass(frozen=True)
class Mismatch:
    """The bucket and the instance are in different regions."""

    store_url: str
    bucket: Placement
    instance: Placement
    endpoint: str | None = None

    def message(self, checkpoint_bytes: int | None, pull_bytes_per_s: float | None) -> str:
        """The warning, with what it costs each resume.

        Example:
            >>> m = Mismatch("s3://b/run", Placement("aws", "eu-west-1"), Placement("aws", "us-east-1"))
            >>> print(m.message(98 * 10**9, None))  # doctest: +ELLIPSIS
            spot_callbacks: s3://b/run is in aws eu-west-1 but this instance runs in aws us-east-1: every resume pulls the 98.0 GB checkpoint across regions, about 16.3 min (980 s) at an assumed 100 MB/s cross-region ...
        """
        speed = pull_bytes_per_s or ASSUMED_CROSS_REGION_BYTES_PER_S
        how = (
            f"at the {speed / 1e6:.0f} MB/s this run's pull measured"
            if pull_bytes_per_s
            else f"at an assumed {speed / 1e6:.0f} MB/s cross-region (no pull measured yet)"
        )
        if checkpoint_bytes:
            seconds = checkpoint_bytes / speed
            figure = format_seconds(seconds) + (f" ({seconds:.0f} s)" if seconds >= 60 else "")
            cost = (
                f"every resume pulls the {checkpoint_bytes / 1e9:.1f} GB checkpoint across regions, "
                f"about {figure} {how}"
            )
        else:
            cost = f"every resume pulls its checkpoint across regions, about {1e9 / speed:.0f} s per GB {how}"
        where = f" (endpoint {self.endpoint})" if self.endpoint else ""
        return (
            f"spot_callbacks: {self.store_url}{where} is in {self.bucket.describe()} but this instance runs in "
            f"{self.instance.describe()}: {cost}, plus transfer charges. Use a bucket in "
            f"{self.instance.region} (or run in {self.bucket.region}); SPOT_REGION_CHECK=0 silences this check"
        )


class RegionCheck:
    """Compares the bucket's region with the instance's, in a daemon thread; :meth:`warn_once` logs the result.

    Args:
        fs: the store's fsspec filesystem.
        path: the store's root path on ``fs`` (``bucket/prefix``).
        store_url: the store's URL, for the message (no credentials).
        timeout_s: per metadata request.

    Example:
        >>> import fsspec
        >>> check = RegionCheck(fsspec.filesystem("memory"), "run", "memory://run")
        >>> check.start(); check.wait(5)
        True
        >>> check.mismatch is None, check.warn_once(None, None)  # not a cloud bucket: nothing to say
        (True, None)
    """

    def __init__(self, fs: Any, path: str, store_url: str, timeout_s: float = DETECT_TIMEOUT_S) -> None:
        self.fs = fs
        self.path = path
        self.store_url = store_url
        self.timeout_s = timeout_s
        self.mismatch: Mismatch | None = None
        self._done = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="spot-region-check", daemon=True)

    @staticmethod
    def enabled() -> bool:
        return settings.REGION_CHECK.value()

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the check has finished."""
        return self._done.wait(timeout)

    def _run(self) -> None:
        try:
            self.mismatch = self.compare()
        except Exception as err:  # noqa: BLE001 - no permission, no network: silent, as documented
            log.debug(
                "spot_callbacks: region check of %s skipped: %s: %s", self.store_url, type(err).__name__, err
            )
        finally:
            self._done.set()

    def compare(self) -> Mismatch | None:
        """Ask both sides; a :class:`Mismatch` when both are known and differ."""
        if backend_of_fs(self.fs).bucket_region is None:
            return None  # local, memory, Azure (no location on the data plane): nothing to compare
        instance = instance_placement(self.timeout_s)
        if instance is None:
            return None
        bucket = bucket_placement(self.fs, self.path)
        if bucket is None or bucket.contains(instance):
            return None
        return Mismatch(self.store_url, bucket, instance, _endpoint(self.fs))

    def warn_once(self, checkpoint_bytes: int | None, pulled: tuple[int, float] | None = None) -> str | None:
        """Log the warning the first time it is called after a mismatch was found; return it (else None).

        ``checkpoint_bytes``: the size of the newest checkpoint. ``pulled``: (bytes, seconds) of
        the pull this run resumed with, if any; the speed comes from it when it was long enough to
        measure one.
        """
        if self._warned or self.mismatch is None or not self._done.is_set():
            return None
        self._warned = True
        speed = None
        if pulled is not None and pulled[0] > 0 and pulled[1] >= MIN_MEASURED_PULL_S:
            speed = pulled[0] / pulled[1]
        message = self.mismatch.message(checkpoint_bytes, speed)
        log.warning("%s", message)
        return message


__all__ = ["Mismatch", "Placement", "RegionCheck", "bucket_placement", "instance_placement"]
