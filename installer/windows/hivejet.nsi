; HiveJet's Windows installer (NSIS 3).
;
; Build with installer/windows/build.ps1 (it makes the payload), or by hand:
;   makensis -DVERSION=0.1.0 -DPAYLOAD=<folder> -DOUTFILE=<setup.exe> installer/windows/hivejet.nsi
; PAYLOAD holds python\ (Python with HiveJet and its dependencies installed, PyTorch's CPU build included, and
; the Microsoft Visual C++ runtime DLLs that torch and Triton load, app-local beside python.exe), hivejet.ico and
; hivejet.cmd. See docs/INSTALL.md.
;
; * Per-user install into %LOCALAPPDATA%\Programs\HiveJet: no administrator rights.
; * Start menu and (optional) desktop shortcuts run `pythonw -m app.firstrun launch`: on the first start it finds
;   the NVIDIA driver and offers the CUDA build of PyTorch (plus triton-windows), with a progress window.
; * Upgrade in place, atomically: a previous install's folder is reused. The new Python environment is unpacked
;   beside the old one (python.new), then swapped in with two renames; the old one is renamed aside first, which
;   fails while HiveJet runs (its files are open): the installer asks to close it (a silent /S install gives up),
;   and every failure before or during the swap removes python.new and puts the old python\ back, so no run,
;   cancelled, silent or failed, leaves a half-deleted tree. The GPU download (gpu-cache) is kept so the GPU
;   build is installed again without downloading it again.
; * The uninstaller removes the program and asks before it deletes models and conversations
;   (%LOCALAPPDATA%\hivejet); a silent uninstall (/S) keeps them.

Unicode true
ManifestDPIAware true

!ifndef VERSION
  !define VERSION "0.0.0"
!endif
!ifndef VIVERSION
  !define VIVERSION "0.0.0.0"
!endif
!ifndef PAYLOAD
  !error "PAYLOAD is not defined: makensis -DPAYLOAD=<folder with python\, hivejet.ico, hivejet.cmd>"
!endif
; The VC++ runtime torch and Triton need, app-local (build.ps1 copies it from Visual Studio's redist folder):
; an installer without it would work only where some other program installed vc_redist.
!macro NEED_DLL name
  !if ! /FileExists "${PAYLOAD}\python\${name}"
    !error "${name} is missing from ${PAYLOAD}\python: build.ps1 copies the VC++ runtime there"
  !endif
!macroend
!insertmacro NEED_DLL "msvcp140.dll"
!insertmacro NEED_DLL "msvcp140_atomic_wait.dll"
!insertmacro NEED_DLL "vcruntime140.dll"
!insertmacro NEED_DLL "vcruntime140_1.dll"
!insertmacro NEED_DLL "vcruntime140_threads.dll"
!ifndef OUTFILE
  !define OUTFILE "HiveJet-${VERSION}-setup.exe"
!endif

!define APP "HiveJet"
!define APP_KEY "Software\HiveJet"
!define UNINST_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\HiveJet"
!define LAUNCH_EXE "$INSTDIR\python\pythonw.exe"
!define LAUNCH_ARGS "-m app.firstrun launch"
!define DATA_DIR "$LOCALAPPDATA\hivejet"

Name "${APP}"
Caption "${APP} ${VERSION} Setup"
OutFile "${OUTFILE}"
RequestExecutionLevel user
InstallDir "$LOCALAPPDATA\Programs\HiveJet"
InstallDirRegKey HKCU "${APP_KEY}" "InstallDir"
SetCompressor /SOLID lzma
BrandingText "${APP} ${VERSION}"
ShowInstDetails show

VIProductVersion "${VIVERSION}"
VIAddVersionKey "ProductName" "${APP}"
VIAddVersionKey "ProductVersion" "${VERSION}"
VIAddVersionKey "FileVersion" "${VERSION}"
VIAddVersionKey "FileDescription" "${APP} installer"
VIAddVersionKey "LegalCopyright" "HiveJet contributors (MIT)"

!include "MUI2.nsh"
!include "LogicLib.nsh"
!include "FileFunc.nsh"

Var PreviousVersion

!define MUI_ICON "${PAYLOAD}\hivejet.ico"
!define MUI_UNICON "${PAYLOAD}\hivejet.ico"
!define MUI_ABORTWARNING
!define MUI_WELCOMEPAGE_TEXT "This installs ${APP} ${VERSION} for your user account (no administrator rights needed).$\r$\n$\r$\nOn its first start HiveJet looks for an NVIDIA GPU and offers to download GPU support (about 2.8 GB). Without a suitable GPU it runs on the CPU.$\r$\n$\r$\nClick Next to continue."
!define MUI_FINISHPAGE_RUN "${LAUNCH_EXE}"
!define MUI_FINISHPAGE_RUN_PARAMETERS "${LAUNCH_ARGS}"
!define MUI_FINISHPAGE_RUN_TEXT "Start HiveJet now"

!insertmacro MUI_PAGE_WELCOME
!define MUI_PAGE_CUSTOMFUNCTION_PRE SkipDirectoryOnUpgrade
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_COMPONENTS
!insertmacro MUI_PAGE_INSTFILES
!insertmacro MUI_PAGE_FINISH

!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_INSTFILES

!insertmacro MUI_LANGUAGE "English"

Function .onInit
  ; Upgrade in place: install over the previous version, wherever it is.
  ReadRegStr $0 HKCU "${UNINST_KEY}" "InstallLocation"
  ReadRegStr $PreviousVersion HKCU "${UNINST_KEY}" "DisplayVersion"
  ${If} $0 != ""
  ${AndIf} ${FileExists} "$0\python\*.*"
    StrCpy $INSTDIR $0
  ${Else}
    StrCpy $PreviousVersion ""
  ${EndIf}
FunctionEnd

Function SkipDirectoryOnUpgrade
  ${If} $PreviousVersion != ""
    Abort
  ${EndIf}
FunctionEnd

; Whether HiveJet runs from python\: a running HiveJet keeps files there open, and Windows refuses to rename a
; folder with open files. Asks to close it; Cancel (the default of a silent install) aborts with nothing changed.
Function WaitUntilNotRunning
  ${IfNot} ${FileExists} "$INSTDIR\python\*.*"
    Return
  ${EndIf}
  check:
  ClearErrors
  Rename "$INSTDIR\python" "$INSTDIR\python.check"
  ${If} ${Errors}
    MessageBox MB_RETRYCANCEL|MB_ICONEXCLAMATION "HiveJet is running (its files are in use).$\r$\nClose HiveJet, then click Retry." /SD IDCANCEL IDRETRY check
    RMDir /r "$INSTDIR\python.new"
    Abort "HiveJet is running: nothing was changed. Close it and run the installer again."
  ${EndIf}
  Rename "$INSTDIR\python.check" "$INSTDIR\python"
FunctionEnd

Function .onInstFailed
  ; whatever stopped the install: the new tree goes, the old one stays (or comes back)
  RMDir /r "$INSTDIR\python.new"
  ${If} ${FileExists} "$INSTDIR\python.old\*.*"
  ${AndIfNot} ${FileExists} "$INSTDIR\python\*.*"
    Rename "$INSTDIR\python.old" "$INSTDIR\python"
  ${EndIf}
FunctionEnd

Section "HiveJet (required)" SecApp
  SectionIn RO
  SetOutPath "$INSTDIR"
  ${If} $PreviousVersion != ""
    DetailPrint "Upgrading HiveJet $PreviousVersion to ${VERSION} in $INSTDIR"
  ${EndIf}
  ; Leftovers of an earlier run that was killed mid-way: a swap that stopped between its two renames gets the
  ; old environment back; a half-unpacked new one goes.
  ${If} ${FileExists} "$INSTDIR\python.old\*.*"
  ${AndIfNot} ${FileExists} "$INSTDIR\python\*.*"
    Rename "$INSTDIR\python.old" "$INSTDIR\python"
  ${EndIf}
  RMDir /r "$INSTDIR\python.new"
  RMDir /r "$INSTDIR\python.old"
  ${If} ${FileExists} "$INSTDIR\python.check\*.*"
  ${AndIfNot} ${FileExists} "$INSTDIR\python\*.*"
    Rename "$INSTDIR\python.check" "$INSTDIR\python"
  ${EndIf}
  Call WaitUntilNotRunning

  ; 1. The new environment beside the old one: nothing of the installed version is touched yet.
  SetOutPath "$INSTDIR\python.new"
  ClearErrors
  File /r "${PAYLOAD}\python\*"
  ${If} ${Errors}
    RMDir /r "$INSTDIR\python.new"
    Abort "Unpacking HiveJet failed (is the disk full?): nothing was changed."
  ${EndIf}
  SetOutPath "$INSTDIR"

  ; 2. The swap: old aside (fails if HiveJet was started meanwhile), new in; any failure restores the old one.
  Call WaitUntilNotRunning
  ${If} ${FileExists} "$INSTDIR\python\*.*"
    ClearErrors
    Rename "$INSTDIR\python" "$INSTDIR\python.old"
    ${If} ${Errors}
      RMDir /r "$INSTDIR\python.new"
      Abort "HiveJet's files are in use: nothing was changed. Close HiveJet and run the installer again."
    ${EndIf}
  ${EndIf}
  ClearErrors
  Rename "$INSTDIR\python.new" "$INSTDIR\python"
  ${If} ${Errors}
    Rename "$INSTDIR\python.old" "$INSTDIR\python"
    RMDir /r "$INSTDIR\python.new"
    Abort "Replacing HiveJet's files failed: the previous version was restored."
  ${EndIf}
  ; 3. The old environment goes; a file that cannot go now is removed at the next restart.
  RMDir /r /REBOOTOK "$INSTDIR\python.old"

  File "${PAYLOAD}\hivejet.ico"
  File "${PAYLOAD}\hivejet.cmd"
  File /nonfatal "${PAYLOAD}\README.txt"
  WriteUninstaller "$INSTDIR\Uninstall.exe"

  CreateShortCut "$SMPROGRAMS\HiveJet.lnk" "${LAUNCH_EXE}" "${LAUNCH_ARGS}" "$INSTDIR\hivejet.ico" 0 SW_SHOWNORMAL "" "Run open language models on your own GPU"

  WriteRegStr HKCU "${APP_KEY}" "InstallDir" "$INSTDIR"
  WriteRegStr HKCU "${APP_KEY}" "Version" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayName" "${APP}"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "Publisher" "HiveJet"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayIcon" "$INSTDIR\hivejet.ico"
  WriteRegStr HKCU "${UNINST_KEY}" "InstallLocation" "$INSTDIR"
  WriteRegStr HKCU "${UNINST_KEY}" "UninstallString" '"$INSTDIR\Uninstall.exe"'
  WriteRegStr HKCU "${UNINST_KEY}" "QuietUninstallString" '"$INSTDIR\Uninstall.exe" /S'
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoRepair" 1
  ${GetSize} "$INSTDIR" "/S=0K" $0 $1 $2
  IntFmt $0 "0x%08X" $0
  WriteRegDWORD HKCU "${UNINST_KEY}" "EstimatedSize" "$0"
SectionEnd

Section "Desktop shortcut" SecDesktop
  SetOutPath "$INSTDIR"
  CreateShortCut "$DESKTOP\HiveJet.lnk" "${LAUNCH_EXE}" "${LAUNCH_ARGS}" "$INSTDIR\hivejet.ico" 0 SW_SHOWNORMAL "" "Run open language models on your own GPU"
SectionEnd

!insertmacro MUI_FUNCTION_DESCRIPTION_BEGIN
  !insertmacro MUI_DESCRIPTION_TEXT ${SecApp} "HiveJet with its own Python (nothing else on the computer is changed)."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecDesktop} "A HiveJet shortcut on the desktop."
!insertmacro MUI_FUNCTION_DESCRIPTION_END

Section "Uninstall"
  ; python\ is renamed aside first: that fails while HiveJet runs, before anything was deleted.
  ${If} ${FileExists} "$INSTDIR\python\*.*"
    ClearErrors
    Rename "$INSTDIR\python" "$INSTDIR\python.uninstall"
    ${If} ${Errors}
      MessageBox MB_OK|MB_ICONEXCLAMATION "HiveJet is running (its files are in use). Close HiveJet and run the uninstaller again: nothing was removed." /SD IDOK
      Abort "HiveJet is running: nothing was removed."
    ${EndIf}
  ${EndIf}
  Delete "$SMPROGRAMS\HiveJet.lnk"
  Delete "$DESKTOP\HiveJet.lnk"
  RMDir /r /REBOOTOK "$INSTDIR\python.uninstall"
  RMDir /r "$INSTDIR\python.new"
  RMDir /r "$INSTDIR\python.old"
  RMDir /r "$INSTDIR\gpu-cache"
  Delete "$INSTDIR\hivejet.ico"
  Delete "$INSTDIR\hivejet.cmd"
  Delete "$INSTDIR\README.txt"
  Delete "$INSTDIR\Uninstall.exe"
  RMDir "$INSTDIR"
  DeleteRegKey HKCU "${UNINST_KEY}"
  DeleteRegKey HKCU "${APP_KEY}"

  ; Models and conversations are the user's: ask (default No; a silent uninstall keeps them).
  ${If} ${FileExists} "${DATA_DIR}\*.*"
    MessageBox MB_YESNO|MB_ICONQUESTION|MB_DEFBUTTON2 "Also delete your HiveJet models and conversations?$\r$\n$\r$\n${DATA_DIR}$\r$\n$\r$\nChoose No to keep them for a later install. Models in a folder you picked yourself are kept either way." /SD IDNO IDNO keep_data
    RMDir /r "${DATA_DIR}"
    keep_data:
  ${EndIf}
SectionEnd
