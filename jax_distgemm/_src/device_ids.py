"""The map from local device ordinals to global device ids, told to the C++ handlers once."""

from __future__ import annotations

import jax

from jax_distgemm import ffi as ffi_modules

_registered: set[str] = set()


def register(platform: str) -> None:
  """Tells the extension of `platform` how this process's ordinals map to global ids (once).

  The handlers tell local TP-group members from members in other processes by this table.
  """
  if platform in _registered:
    return
  module = ffi_modules.module_for(platform)
  devices = jax.local_devices(backend=platform)
  ordinals = [d.local_hardware_id for d in devices]
  ids = [d.id for d in devices]
  if platform == "cpu":
    # NOTE: XLA:CPU hands the handler the device's global id as its DeviceOrdinal, while
    # local_hardware_id counts from 0 in every process: register both (one process: equal).
    ordinals, ids = ordinals + ids, ids + ids
  module.set_device_ids(ordinals, ids)
  _registered.add(platform)
