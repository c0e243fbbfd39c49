"""Host-side batch building: request arenas, input batches, sampling metadata, unified batches."""
