/*
 * ncp_internal.h: helpers shared by the CPU and CUDA halves of an op (argument checks), not part of
 * the public ABI.
 */
#ifndef NCP_INTERNAL_H
#define NCP_INTERNAL_H

#include "ncp/ncp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Scalar-field checks of each op; the CUDA entry points call them before launching. */
ncp_status ncp_thd_partition_check(const ncp_thd_partition_params *p);
ncp_status ncp_mimo_shard_check(const ncp_mimo_shard_params *p);

#ifdef __cplusplus
}
#endif

#endif /* NCP_INTERNAL_H */
