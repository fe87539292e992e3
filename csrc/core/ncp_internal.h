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
/* Checks a sharder call against its plan and points the shard outputs and table into p->out. */
ncp_status ncp_mimo_run_prepare(ncp_mimo_run_params *p);

#ifdef __cplusplus
}
#endif

#endif /* NCP_INTERNAL_H */
