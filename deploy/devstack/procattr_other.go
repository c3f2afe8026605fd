//go:build !linux

package main

import "syscall"

// childAttr puts a child in its own process group, so that Ctrl-C reaches devstack alone and
// devstack stops the children in order. (Only Linux can also tie a child's life to devstack's.)
func childAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
