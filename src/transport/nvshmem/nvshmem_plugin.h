// The boundary between libodc.so and the NVSHMEM transport plugin (libodc_nvshmem.so): libodc
// dlopens the plugin only when a communicator asks for the "nvshmem" transport, so libodc loads
// on machines without NVSHMEM. Both sides are built from the same tree in one build; the ABI
// number catches a plugin left over from another build.
#pragma once

#include "common/status.h"
#include "core/transport.h"
#include "core/transport_spec.h"

// Grows with the Transport vtable and class layout (2: split; 3: fold_streamed_if_idle; 4: an
// intermediate build of 5's branch; 5: get_all narrowing, the device staging's hooks behind
// device_staging(), rank, world size, caps and timeout as data; 6: TransportSpec carries the
// resolved SM budget, ranks per node and NVSHMEM settings; 7: a layout since reverted (d2b102e); 8:
// the device staging's send lane, four hooks more and a stream in DeviceTransport).
#define ODC_NVSHMEM_PLUGIN_ABI 8
#define ODC_NVSHMEM_PLUGIN_NAME "libodc_nvshmem.so"

extern "C" {
// Returns ODC_NVSHMEM_PLUGIN_ABI of the plugin's build.
typedef int (*OdcNvshmemPluginAbiFn)();
// Collective: the transport for `spec` (spec.bootstrap set), or nullptr with *status set. The
// caller owns the returned transport (deleting it runs the plugin's destructor; the plugin is
// never unloaded).
typedef odc::Transport* (*OdcNvshmemCreateFn)(const odc::TransportSpec* spec, odc::Status* status);
}
