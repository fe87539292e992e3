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
/* on_cuda: also require f16/bf16, D in {64, 128} and, in positions mode, a forward schedule. */
ncp_status ncp_sink_attn_check(const ncp_sink_attn_params *p, int on_cuda);
ncp_status ncp_sink_attn_bwd_check(const ncp_sink_attn_bwd_params *p, int on_cuda);

#ifdef __cplusplus
}
#endif

#endif /* NCP_INTERNAL_H */
