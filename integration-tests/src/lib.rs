//! kvlease whole-system tests.
