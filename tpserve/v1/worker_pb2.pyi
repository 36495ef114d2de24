from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoRARequest(_message.Message):
    __slots__ = ("slot", "path")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    slot: int
    path: str
    def __init__(self, slot: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoRAResponse(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "world_size", "ready", "num_kv_blocks_available", "error", "dtype", "device", "num_threads", "step_protocol", "num_state_slots_available", "kv_bytes_per_block")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    STEP_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    ready: bool
    num_kv_blocks_available: int
    error: str
    dtype: str
    device: str
    num_threads: int
    step_protocol: int
    num_state_slots_available: int
    kv_bytes_per_block: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., ready: _Optional[bool] = ..., num_kv_blocks_available: _Optional[int] = ..., error: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., num_threads: _Optional[int] = ..., step_protocol: _Optional[int] = ..., num_state_slots_available: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ("num_kv_blocks", "num_state_slots", "num_host_blocks")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    num_state_slots: int
    num_host_blocks: int
    def __init__(self, num_kv_blocks: _Optional[int] = ..., num_state_slots: _Optional[int] = ..., num_host_blocks: _Optional[int] = ...) -> None: ...

class InitCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepareGrammarRequest(_message.Message):
    __slots__ = ("grammar",)
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    grammar: str
    def __init__(self, grammar: _Optional[str] = ...) -> None: ...

class PrepareGrammarResponse(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...

class WorkerSamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "min_tokens_stop_ids", "logprobs", "top_logprobs", "grammar", "prompt_logprobs", "grammar_stop_ids", "typical_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    min_tokens_stop_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    top_logprobs: int
    grammar: str
    prompt_logprobs: int
    grammar_stop_ids: _containers.RepeatedScalarFieldContainer[int]
    typical_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., min_tokens_stop_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., grammar_stop_ids: _Optional[_Iterable[int]] = ..., typical_p: _Optional[float] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "sampling", "num_prompt_tokens", "history_token_ids", "prompt_token_ids", "lora_slot", "state_slot")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    sampling: WorkerSamplingParams
    num_prompt_tokens: int
    history_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_slot: int
    state_slot: int
    def __init__(self, seq_id: _Optional[int] = ..., sampling: _Optional[_Union[WorkerSamplingParams, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., history_token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., lora_slot: _Optional[int] = ..., state_slot: _Optional[int] = ...) -> None: ...

class ScheduledChunk(_message.Message):
    __slots__ = ("seq_id", "token_ids", "start_position", "new_block_ids", "sample", "num_spec_tokens", "num_draft_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    num_spec_tokens: int
    num_draft_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., num_spec_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_seqs", "scheduled", "finished_seq_ids", "trimmed_block_tables", "decode_seq_ids", "decode_token_ids", "decode_start_positions", "decode_grow_rows", "decode_grow_block_ids", "restored_states", "state_checkpoints", "kv_copies", "num_steps")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TRIMMED_BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_START_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_GROW_ROWS_FIELD_NUMBER: _ClassVar[int]
    DECODE_GROW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STATES_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    KV_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledChunk]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    trimmed_block_tables: _containers.RepeatedCompositeFieldContainer[TrimmedBlockTable]
    decode_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_token_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_start_positions: _containers.RepeatedScalarFieldContainer[int]
    decode_grow_rows: _containers.RepeatedScalarFieldContainer[int]
    decode_grow_block_ids: _containers.RepeatedScalarFieldContainer[int]
    restored_states: _containers.RepeatedCompositeFieldContainer[StateRestore]
    state_checkpoints: _containers.RepeatedCompositeFieldContainer[StateCheckpoint]
    kv_copies: KvTierCopies
    num_steps: int
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledChunk, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., trimmed_block_tables: _Optional[_Iterable[_Union[TrimmedBlockTable, _Mapping]]] = ..., decode_seq_ids: _Optional[_Iterable[int]] = ..., decode_token_ids: _Optional[_Iterable[int]] = ..., decode_start_positions: _Optional[_Iterable[int]] = ..., decode_grow_rows: _Optional[_Iterable[int]] = ..., decode_grow_block_ids: _Optional[_Iterable[int]] = ..., restored_states: _Optional[_Iterable[_Union[StateRestore, _Mapping]]] = ..., state_checkpoints: _Optional[_Iterable[_Union[StateCheckpoint, _Mapping]]] = ..., kv_copies: _Optional[_Union[KvTierCopies, _Mapping]] = ..., num_steps: _Optional[int] = ...) -> None: ...

class StateRestore(_message.Message):
    __slots__ = ("seq_id", "slot")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    slot: int
    def __init__(self, seq_id: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class StateCheckpoint(_message.Message):
    __slots__ = ("seq_id", "num_rows", "slot")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_rows: int
    slot: int
    def __init__(self, seq_id: _Optional[int] = ..., num_rows: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class KvTierCopies(_message.Message):
    __slots__ = ("swap_out_block_ids", "swap_out_slots", "swap_in_slots", "swap_in_block_ids")
    SWAP_OUT_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    swap_out_block_ids: _containers.RepeatedScalarFieldContainer[int]
    swap_out_slots: _containers.RepeatedScalarFieldContainer[int]
    swap_in_slots: _containers.RepeatedScalarFieldContainer[int]
    swap_in_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, swap_out_block_ids: _Optional[_Iterable[int]] = ..., swap_out_slots: _Optional[_Iterable[int]] = ..., swap_in_slots: _Optional[_Iterable[int]] = ..., swap_in_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TrimmedBlockTable(_message.Message):
    __slots__ = ("seq_id", "num_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_blocks: int
    def __init__(self, seq_id: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "error", "logprobs", "prompt_logprobs", "num_accepted_tokens", "expert_token_counts", "model_execute_time_s", "wait_time_s")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_EXECUTE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    error: str
    logprobs: _containers.RepeatedCompositeFieldContainer[SampleLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    num_accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    expert_token_counts: _containers.RepeatedScalarFieldContainer[int]
    model_execute_time_s: float
    wait_time_s: float
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[SampleLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., num_accepted_tokens: _Optional[_Iterable[int]] = ..., expert_token_counts: _Optional[_Iterable[int]] = ..., model_execute_time_s: _Optional[float] = ..., wait_time_s: _Optional[float] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "logprobs", "top")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_position: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: _containers.RepeatedCompositeFieldContainer[TopTokens]
    def __init__(self, seq_id: _Optional[int] = ..., first_position: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ...) -> None: ...

class TopTokens(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SampleLogprobs(_message.Message):
    __slots__ = ("sample_index", "logprob", "top_token_ids", "top_logprobs")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sample_index: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
