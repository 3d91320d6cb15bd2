"""``accelerate.utils.operations``' names: the collectives over every process, checked in
debug mode (`meshfit.accelerator.compat.utilities`)."""

from meshfit.accelerator.compat.utilities import (DistributedOperationException, broadcast,
                                                  broadcast_object_list, copy_tensor_to_devices,
                                                  gather, gather_object, pad_across_processes,
                                                  reduce, send_to_device)

__all__ = ["DistributedOperationException", "broadcast", "broadcast_object_list",
           "copy_tensor_to_devices", "gather", "gather_object", "pad_across_processes",
           "reduce", "send_to_device"]
