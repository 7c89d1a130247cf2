use proc_macro::TokenStream; #[proc_macro_attribute] pub fn py_op(_a: TokenStream, i: TokenStream) -> TokenStream { i }
