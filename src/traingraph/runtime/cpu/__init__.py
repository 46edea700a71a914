"""The CPU side of the runtime: the training graph run as onnxruntime segments with native
kernels between them (:mod:`.segments`), the kernels and their registry (:mod:`.kernels`),
the graph index their matchers share (:mod:`.graph_match`), the load-time check every
kernel passes (:mod:`.verify`) and the C extension they call (:mod:`.native`)."""
