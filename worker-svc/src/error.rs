//! The worker's one error type, and how it maps onto gRPC status codes.

use std::fmt;

/// Result alias of the worker crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the worker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration (model shape, limits, budget) is unusable.
    #[error("invalid config: {0}")]
    Config(String),
    /// A weights file could not be read or does not match the model config.
    #[error("cannot load weights from {path}: {reason}")]
    Weights {
        /// The file that was read.
        path: String,
        /// What was wrong with it.
        reason: String,
    },
    /// Weights and activations alone do not fit in the memory budget.
    #[error(
        "memory budget of {budget_bytes} bytes leaves no room for KV blocks: weights take \
         {weight_bytes} bytes and activations {activation_bytes} bytes"
    )]
    MemoryBudget {
        /// The configured budget.
        budget_bytes: u64,
        /// Bytes of the weights.
        weight_bytes: u64,
        /// Bytes of activations at the largest batch.
        activation_bytes: u64,
    },
    /// A Forward batch is over one of the worker's batch limits.
    #[error("batch has {got} {what}, over the limit {limit_name} = {limit}")]
    BatchOverLimit {
        /// "sequences" or "tokens".
        what: &'static str,
        /// How many the batch has.
        got: usize,
        /// The limit's flag name.
        limit_name: &'static str,
        /// The limit.
        limit: usize,
    },
    /// One sequence of a Forward batch is malformed; nothing was run.
    #[error("sequence {seq_id}: {problem}")]
    InvalidSequence {
        /// The scheduler's id of the offending sequence.
        seq_id: u64,
        /// What is wrong with it.
        problem: SeqProblem,
    },
    /// A disk-tier block file is missing or fails verification (a miss,
    /// never K/V): nothing of the request was applied, the file is gone.
    #[error("disk tier: {0}")]
    DiskBlock(String),
    /// The disk tier's directory or a file could not be used.
    #[error("disk tier i/o: {0}")]
    Disk(String),
    /// A host-tier copy of a Forward request is malformed; nothing was run.
    #[error("tier_copies[{index}]: {message}")]
    InvalidTierCopy {
        /// Its index in the request.
        index: usize,
        /// What is wrong with it.
        message: String,
    },
    /// A pipelined pass cannot run: the pass it follows (`after_step`)
    /// failed, never arrived, or did not run one of its feeding sequences.
    /// Nothing was run.
    #[error("the pass of step {step} this pass follows {problem}")]
    PreviousPass {
        /// The step named by `after_step`.
        step: u64,
        /// What went wrong with it.
        problem: String,
    },
    /// A penalised sequence's token counts are not on this worker, or end
    /// elsewhere than its `start_pos` (see `TokenHistory`); nothing was run.
    #[error("sequence {seq_id}: {problem}; send its history")]
    NoHistory {
        /// The sequence.
        seq_id: u64,
        /// What is missing.
        problem: String,
    },
    /// A constrained sequence's matcher is not on this worker, ends
    /// elsewhere than its `start_pos`, or refused one of its tokens (see
    /// `SamplingParams.constrained`); the scheduler recomputes it.
    #[error("sequence {seq_id}: {problem}; send its grammar and history")]
    NoGrammar {
        /// The sequence.
        seq_id: u64,
        /// What is wrong.
        problem: String,
    },
    /// A peer pull (`PullBlocks`, or a Forward sequence's `peer_pull`) is
    /// malformed: the message names the entry and the problem.
    #[error("{0}")]
    InvalidPull(String),
    /// A peer pull cannot be served as asked (another model or KV type, a
    /// block that does not hold K/V) or failed on the way (the source
    /// refused or went away); the message says which.
    #[error("peer pull: {0}")]
    Pull(String),
    /// The compute backend failed.
    #[error("backend failure: {0}")]
    Backend(String),
    /// Serving failed (reflection, the gRPC server).
    #[error("{0}")]
    Serve(#[from] kvlease_runtime::Error),
}

/// What is wrong with one sequence of a Forward batch.
///
/// A plain enum (not a second error type): it is always carried inside
/// [`Error::InvalidSequence`], which names the sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqProblem {
    /// The sequence id appears more than once in the batch.
    DuplicateId,
    /// No tokens to run.
    NoTokens,
    /// `feed_previous` set together with tokens of its own.
    FeedWithTokens {
        /// How many tokens it gave.
        tokens: usize,
    },
    /// `feed_previous` set on a request without `after_step`.
    FeedWithoutAfterStep,
    /// A token id outside the vocabulary.
    TokenOutOfVocab {
        /// Index in the sequence's tokens.
        index: usize,
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab_size: u32,
    },
    /// The positions run past the model's context.
    PastMaxContext {
        /// One past the last position.
        end: u64,
        /// The model's max context.
        max_context: u32,
    },
    /// Sampling parameters out of range.
    BadSampling(String),
    /// Malformed log-probability parameters.
    BadLogprobs(String),
    /// A malformed `history`.
    BadHistory(String),
    /// A `grammar` that cannot be used (does not compile, or comes without
    /// `constrained` or the history).
    BadGrammar(String),
    /// No block table for one of the model's pools.
    MissingTable {
        /// The pool's window.
        window: u32,
    },
    /// Two tables for the same pool.
    DuplicateTable {
        /// The pool's window.
        window: u32,
    },
    /// A table for a window the model has no pool for.
    UnknownWindow {
        /// The table's window.
        window: u32,
    },
    /// A table for a beam other than 0.
    BeamNotZero {
        /// The table's window.
        window: u32,
        /// The table's beam.
        beam: u32,
    },
    /// A block id past the end of the pool.
    BlockOutOfRange {
        /// The pool's window.
        window: u32,
        /// The block id.
        block_id: u32,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// The same block listed twice in one table.
    RepeatedBlock {
        /// The pool's window.
        window: u32,
        /// The block id.
        block_id: u32,
    },
    /// The table does not cover the positions the pass reads or writes.
    TableTooShort {
        /// The pool's window.
        window: u32,
        /// First position read or written.
        first_pos: u64,
        /// Last position written.
        last_pos: u64,
        /// First block index the table covers.
        first_block: u32,
        /// Block indices the table covers.
        num_blocks: usize,
    },
    /// A position before `start_pos` that the pass must read was never written.
    MissingKv {
        /// The pool's window.
        window: u32,
        /// The position.
        position: u64,
        /// The block that should hold it.
        block_id: u32,
        /// The sequence's start position.
        start_pos: u32,
    },
    /// A partial-block copy that cannot be applied as given.
    BadCopy {
        /// The pool's window.
        window: u32,
        /// What is wrong with it.
        message: String,
    },
    /// Two sequences of the batch write the same KV slot.
    SlotConflict {
        /// The pool's window.
        window: u32,
        /// The block id.
        block_id: u32,
        /// The slot in the block.
        slot: u32,
        /// The other sequence.
        other_seq_id: u64,
    },
}

impl fmt::Display for SeqProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SeqProblem::DuplicateId => write!(f, "duplicate sequence id in the batch"),
            SeqProblem::NoTokens => write!(f, "no tokens to run"),
            SeqProblem::FeedWithTokens { tokens } => write!(
                f,
                "feed_previous is set but tokens holds {tokens}: a pipelined decode item runs \
                 exactly the token its previous pass sampled, so tokens must be empty"
            ),
            SeqProblem::FeedWithoutAfterStep => write!(
                f,
                "feed_previous is set but the request's after_step is 0: it must name the pass \
                 whose sampled token this item feeds"
            ),
            SeqProblem::TokenOutOfVocab {
                index,
                token,
                vocab_size,
            } => write!(
                f,
                "token {token} at index {index} is outside the vocabulary of {vocab_size}"
            ),
            SeqProblem::PastMaxContext { end, max_context } => write!(
                f,
                "inconsistent positions: positions up to {} exceed max_context {max_context}",
                end.saturating_sub(1)
            ),
            SeqProblem::BadSampling(what) => write!(f, "bad sampling parameters: {what}"),
            SeqProblem::BadLogprobs(what) => write!(f, "bad logprobs parameters: {what}"),
            SeqProblem::BadHistory(what) => write!(f, "history {what}"),
            SeqProblem::BadGrammar(what) => write!(f, "grammar: {what}"),
            SeqProblem::MissingTable { window } => {
                write!(f, "no block table for the pool of window {window}")
            }
            SeqProblem::DuplicateTable { window } => {
                write!(f, "two block tables for the pool of window {window}")
            }
            SeqProblem::UnknownWindow { window } => {
                write!(
                    f,
                    "block table for window {window}, but the model has no such pool"
                )
            }
            SeqProblem::BeamNotZero { window, beam } => write!(
                f,
                "block table for window {window} has beam {beam}; only beam 0 is supported"
            ),
            SeqProblem::BlockOutOfRange {
                window,
                block_id,
                num_blocks,
            } => write!(
                f,
                "block id {block_id} out of range in the pool of window {window} \
                 ({num_blocks} blocks)"
            ),
            SeqProblem::RepeatedBlock { window, block_id } => write!(
                f,
                "block id {block_id} listed twice in the table for window {window}"
            ),
            SeqProblem::TableTooShort {
                window,
                first_pos,
                last_pos,
                first_block,
                num_blocks,
            } => write!(
                f,
                "block table too short for window {window}: positions {first_pos}..={last_pos} \
                 need blocks the table does not cover (it covers block indices \
                 [{first_block}, {}))",
                u64::from(*first_block) + *num_blocks as u64
            ),
            SeqProblem::MissingKv {
                window,
                position,
                block_id,
                start_pos,
            } => write!(
                f,
                "inconsistent positions: start_pos {start_pos} needs K/V of position {position} \
                 (block {block_id}, window {window}), which was never written"
            ),
            SeqProblem::BadCopy { window, message } => {
                write!(
                    f,
                    "partial-block copy in the pool of window {window}: {message}"
                )
            }
            SeqProblem::SlotConflict {
                window,
                block_id,
                slot,
                other_seq_id,
            } => write!(
                f,
                "inconsistent positions: writes slot {slot} of block {block_id} (window {window}), \
                 which sequence {other_seq_id} also writes"
            ),
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        let message = error.to_string();
        match error {
            Error::BatchOverLimit { .. }
            | Error::InvalidSequence { .. }
            | Error::InvalidTierCopy { .. }
            | Error::InvalidPull(_) => tonic::Status::invalid_argument(message),
            Error::Config(_)
            | Error::Weights { .. }
            | Error::MemoryBudget { .. }
            | Error::PreviousPass { .. }
            | Error::NoHistory { .. }
            | Error::NoGrammar { .. }
            | Error::DiskBlock(_)
            | Error::Pull(_) => tonic::Status::failed_precondition(message),
            Error::Backend(_) | Error::Disk(_) => tonic::Status::internal(message),
            Error::Serve(_) => tonic::Status::unavailable(message),
        }
    }
}
