"""Record encoding: one input record in, its tokens and label-aligned loss mask out.

The lower wing of :mod:`megatron_sft_idx.preprocess`. It imports nothing of the run above it
(the driver, the stages, the store, receipts, outputs): the import contract keeps it so.

Where things live: :mod:`.inputs` (input files and their kinds), :mod:`.sources` (one input, a
local file or an object in storage, behind one interface), :mod:`.json_array` (the streaming
JSON-array scanner), :mod:`.partitions` (byte ranges and row groups of an input), :mod:`.shapes`
(input shapes mapped to the chat template's vocabulary, every key accounted for: a module a
shape, and the registry that tells them apart), :mod:`.accounting` (nothing rendered that the
record does not hold), :mod:`.rendering` (what a template renders), :mod:`.policy` (loss
policies), :mod:`.chat` (chat templates and masks), :mod:`.spans` (trained spans located in a
rendering), :mod:`.encode` (records to tokens, batched), :mod:`.fast_tokenizer`,
:mod:`.source_check` (the independent check against the source record) with :mod:`.key_scan`
(its own reading of a record's bytes for a key named twice), :mod:`.errors` (input
and output errors naming ``file:line``).
"""
