// The paged KV cache (KvCache, KvCacheShape, BlocksFor) is declared in backend.h: the backend
// creates it. An executor owns it (model_executor.h); the scheduler's KvBlockAllocator
// (moe/scheduler/kv_block_allocator.h) hands out its blocks.
#pragma once

#include "moe/runtime/backend.h"
