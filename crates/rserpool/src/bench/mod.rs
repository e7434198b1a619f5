pub mod handlespace;
