//! `ir`: the front half of widen.
//!
//! Data flows one way (docs/architecture.md §2): a [`spec::ModelSpec`] (from RON or the
//! derive) is validated, lowered to a [`graph::Graph`], differentiated and
//! costed. The reference executor in [`exec`] is the oracle every other
//! backend is tested against.

pub mod autodiff;
pub mod cost;
pub mod dtype;
pub mod exec;
pub mod graph;
pub mod lower;
pub mod passes;
pub mod shape;
pub mod spec;

pub use dtype::DType;
pub use shape::Shape;
