"""The learner's device copy of a buffer: ``DeviceReplay`` (``device/replay.py``: the samples and
lag bounds), on ``DeviceRows`` (``device/rows.py``: the rows on the device and their refresh) and
a background refresher (``device/refresher.py``)."""

from .replay import DEFAULT_MAX_LAG_S, DEFAULT_PACE_S, REFRESH_AT, DeviceReplay
from .rows import DeviceRows

__all__ = ["DEFAULT_MAX_LAG_S", "DEFAULT_PACE_S", "REFRESH_AT", "DeviceReplay", "DeviceRows"]
