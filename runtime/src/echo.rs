//! How much of a caller's input an error message may quote: a message that
//! echoed a 1 MB field whole pushed replies over the message cap (issue 29,
//! point 9).

/// `input` quoted (as `{:?}` does) up to its first `chars` characters; a
/// longer one is cut there and says how many bytes it had.
pub fn clip(input: &str, chars: usize) -> String {
    match input.char_indices().nth(chars) {
        None => format!("{input:?}"),
        Some((end, _)) => format!("{:?}... ({} bytes)", &input[..end], input.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::clip;

    #[test]
    fn a_long_input_is_cut_at_a_character_and_says_its_size() {
        assert_eq!(clip("abc", 3), "\"abc\"");
        assert_eq!(clip("abcd", 3), "\"abc\"... (4 bytes)");
        // cut between characters, never inside one
        assert_eq!(clip("ééé", 2), "\"éé\"... (6 bytes)");
    }
}
